"""Fixtures of the Megatron train-engine tests: tiny HF checkpoints written by the embedded engine,
matching embedded / megatron engine pairs, batches with and without rollout routes.

The in-process (``launcher="local"``) engines initialise torch.distributed (gloo, world size 1)
and megatron's parallel state in the pytest process; a package-scoped fixture tears both down after
this directory's tests so later test modules see a clean process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.engines.model import ModelConfig
from training.engines.train import OptimConfig, TokenBatch

V = 100  # CharTokenizer's vocabulary; TP tests use 101 to exercise vocabulary padding

OPTIM = OptimConfig(lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1, grad_clip=0.5,
                    lr_schedule="cosine", warmup_steps=1, total_steps=6, min_lr_ratio=0.1)


class Helpers:
    """Shared builders (one instance per session: HF directories are written once)."""

    V = V
    OPTIM = OPTIM

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[tuple, Path] = {}

    @staticmethod
    def cfg(experts: int = 0, vocab: int = V, tie: bool = False) -> ModelConfig:
        return ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, intermediate_size=48, num_experts=experts,
                           num_experts_per_tok=2, tie_word_embeddings=tie)

    def hf_dir(self, experts: int = 0, vocab: int = V, tie: bool = False) -> Path:
        """An HF directory of a seeded random model, written by the embedded engine."""
        from training.engines.embedded.trainer import EmbeddedTrainEngine

        key = (experts, vocab, tie)
        if key not in self._dirs:
            d = self.root / f"hf-e{experts}-v{vocab}-t{int(tie)}"
            EmbeddedTrainEngine.from_config(self.cfg(experts, vocab, tie), seed=3).export_weights(d)
            self._dirs[key] = d
        return self._dirs[key]

    def pair(self, experts: int = 0, optim: OptimConfig = OPTIM, **hf: object):
        """(embedded engine, in-process megatron engine) warm started from the same weights."""
        from training.engines.embedded.trainer import EmbeddedTrainEngine
        from training.engines.megatron.engine import MegatronTrainEngine

        d = self.hf_dir(experts, **hf)
        return (EmbeddedTrainEngine.from_pretrained(d, optim=optim),
                MegatronTrainEngine.from_pretrained(d, optim=optim, launcher="local"))

    @staticmethod
    def batch(n: int = 6, seed: int = 1, routes_for: ModelConfig | None = None,
              vocab: int = V) -> TokenBatch:
        """n prompt/response pairs of random lengths (one empty response); with
        ``routes_for`` also random rollout routes (distinct experts per token and layer)."""
        g = torch.Generator().manual_seed(seed)

        def ids(lo: int, hi: int) -> list[int]:
            k = int(torch.randint(lo, hi, (1,), generator=g))
            return torch.randint(4, vocab, (k,), generator=g).tolist()

        prompts = [[1, *ids(1, 6)] for _ in range(n)]
        responses = [[*ids(0, 7), 2] for _ in range(n - 1)] + [[]]
        routes = None
        if routes_for is not None:
            c = routes_for
            routes = []
            for p, r in zip(prompts, responses, strict=True):
                rows = (len(p) + len(r) - 1) * c.num_layers
                picks = [torch.randperm(c.num_experts, generator=g)[: c.num_experts_per_tok]
                         for _ in range(rows)]
                routes.append(torch.stack(picks).view(len(p) + len(r) - 1, c.num_layers,
                                                      c.num_experts_per_tok))
        return TokenBatch.from_sequences(prompts, responses, routes=routes)

    @staticmethod
    def adv(batch: TokenBatch, seed: int = 2) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch.batch_size, batch.response_len, generator=g)

    @staticmethod
    def params(engine) -> dict[str, torch.Tensor]:
        """HF-named weights of either engine."""
        if hasattr(engine, "hf_state_dict"):
            return engine.hf_state_dict()
        return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.fixture(scope="session")
def mg(tmp_path_factory) -> Helpers:
    return Helpers(tmp_path_factory.mktemp("megatron-hf"))


@pytest.fixture(scope="package", autouse=True)
def _clean_distributed():
    """Leave no process group or megatron parallel state behind in the pytest process."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
