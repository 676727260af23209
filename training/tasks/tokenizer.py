"""The embedded models' tokenizer: one token per printable ASCII character, plus special tokens.

Saved in Hugging Face *tokenizers* format (``tokenizer.json`` + ``tokenizer_config.json``) inside
every checkpoint directory, so ``transformers.AutoTokenizer.from_pretrained(ckpt_dir)`` loads it
and SGLang can serve the checkpoint with ``text`` prompts. Character level keeps the vocabulary
tiny (99 ids) while still covering any ASCII JSONL dataset a user brings.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
# printable ASCII without \t \r \x0b \x0c, plus newline
CHARS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


class CharTokenizer:
    """Character tokenizer; ids 0..3 are <pad> <bos> <eos> <unk>."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self._tok = tokenizer or self._build()
        vocab = self._tok.get_vocab()
        self.pad_token_id = vocab[PAD]
        self.bos_token_id = vocab[BOS]
        self.eos_token_id = vocab[EOS]
        self.unk_token_id = vocab[UNK]
        self.vocab_size = self._tok.get_vocab_size()

    @staticmethod
    def _build() -> Tokenizer:
        vocab = {tok: i for i, tok in enumerate(SPECIALS)}
        for c in CHARS:
            vocab.setdefault(c, len(vocab))
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(SPECIALS))
        return tok

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        self._tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
        }, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; a checkpoint directory must hold "
                                    "tokenizer.json (re-export it with asyncrl)")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise ValueError(f"{path} is unreadable ({e}); re-export the checkpoint's "
                             "tokenizer") from None
