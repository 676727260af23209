"""Hugging Face-format model directories: the one weight format every engine reads and writes.

A directory holds ``config.json`` (LlamaForCausalLM / MixtralForCausalLM), ``model.safetensors``
(HF parameter names), ``generation_config.json``, ``tokenizer.json`` + ``tokenizer_config.json``
and ``asyncrl.json`` (our metadata: the weight version and free-form provenance). SGLang's
``/update_weights_from_disk`` and ``transformers.AutoModelForCausalLM.from_pretrained`` read the
same directory, so a weight sync is the same call for every rollout backend.

Writes are atomic: the directory is assembled under a temporary name next to the target and
renamed into place, so a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from training.engines.model import CausalLM, ModelConfig
from training.fileio import recover_dir, replace_dir
from training.tasks.tokenizer import CharTokenizer

META_FILE = "asyncrl.json"
WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS_FILE)


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, empty or unreadable (the message names the fix)."""


@dataclass
class LoadedCheckpoint:
    model: CausalLM
    config: ModelConfig
    tokenizer: CharTokenizer
    weight_version: int
    meta: dict[str, Any] = field(default_factory=dict)


def state_dict_for_export(model: CausalLM) -> dict[str, torch.Tensor]:
    """fp32, contiguous, CPU tensors under HF names (a tied LM head is stored once)."""
    sd = {k: v.detach().to("cpu", torch.float32).contiguous()
          for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_hf_dir(
    directory: str | Path,
    model: CausalLM,
    tokenizer: CharTokenizer,
    weight_version: int = 0,
    meta: dict[str, Any] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` (or a ready ``state_dict``) as an HF directory, atomically.

    Args:
        directory: target directory (replaced if it exists).
        model: the model whose config (and weights, unless ``state_dict`` is given) are written.
        tokenizer: saved beside the weights.
        weight_version: recorded in ``asyncrl.json``; rollout engines report it per token.
        meta: extra provenance stored in ``asyncrl.json`` (JSON-serialisable).
        state_dict: weights to write instead of ``model``'s (e.g. a retained snapshot).
    Returns:
        the directory path.
    """
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        cfg = model.config
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id}, indent=2) + "\n")
        weights = state_dict if state_dict is not None else state_dict_for_export(model)
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()},
                  str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        tokenizer.save(tmp)
        (tmp / META_FILE).write_text(json.dumps(
            {"weight_version": int(weight_version), **(meta or {})}, indent=2, default=str) + "\n")
        move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def move_into_place(tmp: Path, target: Path) -> None:
    """Rename a fully written directory ``tmp`` to ``target``, replacing any old ``target``
    (readers see the old or the new directory, never a mix; fsynced, and a kill between the
    renames is undone by :func:`training.fileio.recover_dir`)."""
    replace_dir(tmp, target)


def check_hf_dir(directory: str | Path) -> Path:
    """Raise :class:`CheckpointError` unless ``directory`` looks like a complete checkpoint."""
    d = Path(directory)
    if not d.exists() and not recover_dir(d):  # recover_dir: a swap killed half-way
        raise CheckpointError(f"checkpoint {d} does not exist; pass a directory written by "
                              "`asyncrl warmstart` or a trainer export")
    if not d.is_dir():
        raise CheckpointError(f"checkpoint {d} is not a directory; pass the checkpoint directory")
    if not any(d.iterdir()):
        raise CheckpointError(f"checkpoint {d} is empty; refusing to start from random weights — "
                              "point to a directory that holds config.json and model.safetensors")
    missing = [f for f in REQUIRED_FILES if not (d / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {d} lacks {', '.join(missing)}; it is not an HF model "
                              "directory (re-export it)")
    return d


def read_model_config(directory: str | Path) -> ModelConfig:
    d = check_hf_dir(directory)
    try:
        return ModelConfig.from_hf_dict(json.loads((d / "config.json").read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{d / 'config.json'} is unreadable ({e}); re-export the "
                              "checkpoint") from None


def read_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    d = check_hf_dir(directory)
    try:
        return load_file(str(d / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises several types for corrupt files
        raise CheckpointError(f"{d / WEIGHTS_FILE} is unreadable ({type(e).__name__}: {e}); "
                              "re-export the checkpoint") from None


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META_FILE
    if not path.is_file():
        return {"weight_version": 0}
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg}); re-export the "
                              "checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} must hold a JSON object; re-export the checkpoint")
    version = meta.get("weight_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CheckpointError(f"{path}: weight_version must be an integer >= 0, got "
                              f"{version!r}; fix the file or re-export the checkpoint")
    meta["weight_version"] = version
    return meta


def load_weights_into(model: CausalLM, state_dict: dict[str, torch.Tensor],
                      source: str | Path = "state dict") -> None:
    """Copy HF-named weights into ``model`` in place (keeping its dtype); names must match."""
    expected = set(state_dict_for_export(model))
    got = set(state_dict)
    if model.config.tie_word_embeddings:
        got.discard("lm_head.weight")
    if expected != got:
        missing, extra = sorted(expected - got)[:3], sorted(got - expected)[:3]
        raise CheckpointError(f"{source} does not match the model architecture (missing "
                              f"{missing}, unexpected {extra}); check config.json")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state_dict.items():
            if name in params:
                if params[name].shape != value.shape:
                    raise CheckpointError(f"{source}: {name} has shape {tuple(value.shape)}, "
                                          f"model expects {tuple(params[name].shape)}")
                params[name].copy_(value.to(params[name].dtype))


def load_hf_dir(directory: str | Path, dtype: torch.dtype = torch.float32) -> LoadedCheckpoint:
    """Load a checkpoint directory; every failure is a :class:`CheckpointError` naming the fix."""
    cfg = read_model_config(directory)
    model = CausalLM(cfg)
    load_weights_into(model, read_state_dict(directory), source=directory)
    model = model.to(dtype)
    try:
        tokenizer = CharTokenizer.load(directory)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(str(e)) from None
    meta = read_meta(directory)
    return LoadedCheckpoint(model=model, config=cfg, tokenizer=tokenizer,
                            weight_version=meta["weight_version"], meta=meta)
