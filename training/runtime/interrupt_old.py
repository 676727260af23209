"""The rollouter's copy of the served policy for ``old_logprob: interrupt`` (seed 003 §5.1,
"synchronization via partial rollout interruption").

π_old of a token is the trainer-side log-prob under the weight version that generated it. Under
this strategy the rollouter computes it while that version is still the one the engines serve:
at each sync, before the new weights load, for the tokens its in-flight samples have so far, and
for the rest when a sample finishes. :class:`HeldPolicy` is the fp32 copy that does it, on the
embedded trainer's own forward (:meth:`EmbeddedTrainEngine.compute_log_probs`, the rollout
temperature), so the values are the trainer's log-probs at that version.

Departures from the seed: the seed switches the rollout placement's resources to actor-side
old-logit computation for the duration; here the copy lives in the rollouter's process beside the
engines and costs one fp32 copy of the parameters (:attr:`HeldPolicy.nbytes`) instead of a
placement switch. Nothing older than the served version is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["HeldPolicy"]


class HeldPolicy:
    """fp32 training-side copy of the weights the rollout engines serve.

    Args:
        path: HF directory the engines serve now (the run's initial checkpoint, or a resume's).
        version: the weight version of ``path``.
        temperature: the rollout temperature (log-probs of ``logits / temperature``).
    """

    def __init__(self, path: str | Path, version: int, temperature: float) -> None:
        from training.engines.embedded.trainer import EmbeddedTrainEngine

        self.engine = EmbeddedTrainEngine.from_pretrained(path, snapshot_budget_bytes=0,
                                                          route_cache_sequences=0)
        self.engine.model.requires_grad_(False)
        self.version = int(version)
        self.temperature = float(temperature)

    @property
    def nbytes(self) -> int:
        """Bytes of the held parameters (one fp32 copy)."""
        return int(self.engine.parameter_bytes())

    def load(self, path: str | Path, version: int) -> None:
        """Hold the weights of ``path`` as ``version`` (the engines just loaded them); the same
        version again is a no-op."""
        if int(version) == self.version:
            return
        from training.engines.hf_io import load_weights_into, read_state_dict

        load_weights_into(self.engine.model, read_state_dict(path), source=path)
        self.version = int(version)

    def log_probs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  starts: Sequence[int]) -> list[list[float]]:
        """Log-probs of ``responses[i][starts[i]:]`` given the prompt and the response tokens
        before them, under the held weights (one padded forward over all rows).

        Args:
            prompts: B prompt id lists (starting with <bos>).
            responses: B response id lists (each non-empty).
            starts: B offsets into the responses: the first token each row needs.
        Returns:
            B lists, row i of length ``len(responses[i]) - starts[i]``.
        """
        from training.engines.train import TokenBatch

        batch = TokenBatch.from_sequences([list(p) for p in prompts],
                                          [list(r) for r in responses])
        lp = self.engine.compute_log_probs(batch, temperature=self.temperature,
                                           with_entropy=False).log_probs
        return [lp[i, k:len(r)].tolist() for i, (r, k) in enumerate(zip(responses, starts,
                                                                          strict=True))]
