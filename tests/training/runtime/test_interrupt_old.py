"""``old_logprob: interrupt`` (seed 003 §5.1): π_old computed by the rollouter before each version
leaves the engines, checked token by token.

The Rollouter (in-process, no Ray) generates long responses on a real fp32 embedded server while
the test pushes new trainer weights three times with ``sync_weights``. At each sync the engines
abort, the rollouter computes π_old of the tokens generated so far with its copy of the served
weights, then loads the new ones. Every token's carried π_old must equal the trainer's own
log-prob at the token's version (the trainer keeps snapshots of every version here, so it can
say), and the Learner must train on exactly those values.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from training.engines.embedded.launch import EmbeddedServer
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.train import OptimConfig, TokenBatch
from training.engines.warmstart import WarmStartConfig, warm_start
from training.recipe import RecipeError, recipe_from_dict
from training.runtime.actors import SampleBuffer
from training.runtime.interrupt_old import HeldPolicy
from training.runtime.learner import Learner
from training.runtime.rollouter import Rollouter
from training.runtime.types import Group, Sample


@pytest.fixture(scope="module")
def tiny_ckpt(module_home):
    return warm_start(WarmStartConfig(steps=60, hidden_size=32, num_layers=2)).path


def _recipe(path, **algorithm):
    return recipe_from_dict({
        "steps": 4,
        "model": {"kind": "checkpoint", "path": str(path)},
        "rollout": {"n": 2, "batch_prompts": 4, "temperature": 3.0, "max_response_tokens": 200},
        "async": {"mode": "fully_async", "staleness_threshold": 1.0, "partial_rollout": True},
        "data": {"drain": "fifo", "dispatch": "fifo", "max_in_flight": 4},
        "algorithm": {"old_logprob": "interrupt", "correction": {"kind": "compis"},
                      **algorithm},
    })


def _nudge(engine: EmbeddedTrainEngine) -> None:
    """One optimizer step on a fixed batch (any update makes a new version)."""
    batch = TokenBatch.from_sequences([[1, 10, 11]] * 2, [[12, 13, 2], [14, 2]])
    old = engine.compute_log_probs(batch).log_probs
    engine.train_step(batch, torch.ones_like(old), old)


async def _until_decoding(url: str) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(500):
            state = (await http.get(url + "/server_info")).json()["internal_states"][0]
            if state["running"] > 0 and state["generated_tokens"] > 0:
                return
            await asyncio.sleep(0.002)


@pytest.mark.slow
def test_carried_old_logprobs_are_the_trainer_at_each_tokens_version(tiny_ckpt, tmp_path):
    recipe = _recipe(tiny_ckpt)
    assert recipe.partial_interrupt == "abort_resume"  # auto: the tokens come back at a pause
    engine = EmbeddedTrainEngine.from_pretrained(tiny_ckpt, optim=OptimConfig(lr=5e-2))
    v0 = engine.weight_version
    with EmbeddedServer(tiny_ckpt, dtype="fp32", threads=1) as server:

        async def scenario():
            buffer = SampleBuffer("fifo", 64)
            rollouter = Rollouter(recipe, [server.url], buffer, None, version=v0,
                                  weights_path=str(tiny_ckpt))
            await rollouter.start()
            syncs = []
            try:
                for i in range(1, 4):  # three syncs while responses are being generated
                    _nudge(engine)
                    await _until_decoding(server.url)
                    path = tmp_path / f"v{engine.weight_version}"
                    engine.export_weights(path)
                    syncs.append(await rollouter.sync_weights(str(path), engine.weight_version,
                                                              i, 0))
                groups = await buffer.take(8, timeout=60)
                assert groups is not None
                return groups, syncs, await rollouter.stats()
            finally:
                await rollouter.stop()

        groups, syncs, stats = asyncio.run(scenario())
    samples = [s for g in groups for s in g.samples]
    partial = [s for s in samples if s.spans_sync]
    assert partial, "no sample was caught by a sync mid-generation"
    assert all(len(s.old_log_probs) == s.response_len for s in samples)
    assert stats["async/rollouter/old_logit_missing"] == 0
    assert stats["async/rollouter/sample_retries"] == 0
    # the cost: every sync stalled for the aborted tokens' π_old and the copy's load; the
    # copy is one fp32 set of the parameters
    assert all(out["async/old_logit_interrupt_s"] > 0 for out in syncs)
    assert stats["async/old_logit_s"] > 0
    assert stats["async/old_logit_held_bytes"] == 4 * sum(
        p.numel() for p in engine.model.parameters())

    batch = TokenBatch.from_sequences([s.prompt_ids for s in samples],
                                      [s.response_ids for s in samples])
    carried = torch.zeros(batch.batch_size, batch.response_len)
    versions = torch.full_like(carried, -1, dtype=torch.long)
    for i, s in enumerate(samples):
        carried[i, :s.response_len] = torch.tensor(s.old_log_probs)
        versions[i, :s.response_len] = torch.tensor(s.token_versions)
    seen = sorted(set(versions[versions >= 0].tolist()))
    assert len(seen) >= 3  # tokens of several versions: the check below can tell them apart
    for v in seen:
        trainer = engine.compute_log_probs(batch, version=int(v), temperature=3.0).log_probs
        hit = versions == v
        torch.testing.assert_close(carried[hit], trainer[hit])
        # and tokens of version v are not what a neighbouring version would give
        other = engine.compute_log_probs(batch, version=int(v) + 1 if v < max(seen) else
                                         int(v) - 1, temperature=3.0).log_probs
        assert float((carried[hit] - other[hit]).abs().max()) > 1e-3

    learner = Learner(engine, recipe, keep_tensors=True)
    spanning = [g for g in groups if g.partial]
    result = learner.step(spanning, step=3)
    assert result.trained
    dbg = result.debug
    mask = dbg["response_mask"].bool()
    rows = [s for g in spanning for s in g.samples]
    for i, s in enumerate(rows):
        m = mask[i, :s.response_len]
        assert torch.equal(dbg["old_log_prob"][i, :s.response_len][m],
                           torch.tensor(s.old_log_probs)[m])
    assert result.metrics["old/interrupt_fallback_frac"] == 0.0
    assert result.metrics["old/exact_frac"] == 1.0


def test_a_sample_without_old_logprobs_falls_back_and_is_counted(tiny_ckpt):
    engine = EmbeddedTrainEngine.from_pretrained(tiny_ckpt)
    recipe = _recipe(tiny_ckpt)
    held = HeldPolicy(tiny_ckpt, engine.weight_version, temperature=3.0)
    prompt = [1, 20, 21, 22]
    responses = [[30, 31, 32, 2], [33, 34, 2], [35, 2], [36, 37, 38, 39, 2]]
    # the copy's values, asked from two offsets, are the trainer's at the same version
    full = held.log_probs([prompt] * 4, responses, [0, 0, 0, 0])
    tail = held.log_probs([prompt] * 4, responses, [2, 1, 1, 3])
    assert [len(t) for t in tail] == [2, 2, 1, 2]
    assert [f[k:] for f, k in zip(full, [2, 1, 1, 3], strict=True)] == tail
    samples = [Sample(group_id=g, sample_index=j, prompt_id=f"p{g}", prompt_ids=prompt,
                      response_ids=r, rollout_log_probs=full[2 * g + j],
                      token_versions=[0] * len(r), loss_mask=[1] * len(r),
                      reward=float(j), old_log_probs=full[2 * g + j] if (g, j) != (1, 1) else [])
               for g in range(2) for j, r in enumerate(responses[2 * g:2 * g + 2])]
    groups = [Group(group_id=g, prompt_id=f"p{g}", difficulty=None, answer="", submit_step=0,
                    samples=samples[2 * g:2 * g + 2]) for g in range(2)]
    result = Learner(engine, recipe, keep_tensors=True).step(groups, step=0)
    loss_tokens = sum(len(r) for r in responses)
    assert result.metrics["old/interrupt_fallback_frac"] == pytest.approx(5 / loss_tokens)
    assert result.metrics["old/exact_frac"] == pytest.approx(1 - 5 / loss_tokens)
    dbg = result.debug
    assert torch.equal(dbg["interrupt_fallback_mask"][3, :5], torch.ones(5, dtype=torch.bool))
    assert torch.equal(dbg["old_log_prob"][3], dbg["current_log_prob"][3])
    torch.testing.assert_close(dbg["old_log_prob"][0, :4], torch.tensor(full[0]))


@pytest.mark.parametrize(("data", "fix"), [
    ({"async": {"mode": "fully_async", "interrupt": "retract"}},
     "set async.interrupt: abort_resume"),
    ({"engines": {"train": "megatron"}},
     "not engines.train: megatron's; use old_logprob: snapshot"),
    ({"model": {"kind": "warmstart", "moe_experts": 4}, "algorithm": {"routing_replay": "r2"}},
     "not routing_replay r2; set algorithm.routing_replay: none"),
    ({"model": {"kind": "warmstart", "moe_experts": 4}, "algorithm": {"routing_replay": "r3"}},
     "not routing_replay r3"),
])
def test_combinations_interrupt_cannot_run_are_refused(data, fix):
    data = {**data, "algorithm": {"old_logprob": "interrupt", **data.get("algorithm", {})}}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    msg = str(info.value)
    assert fix in msg and "\n" not in msg, msg


def test_interrupt_runs_without_partial_rollout_and_in_lockstep_modes():
    for spec in ({"mode": "sync"}, {"mode": "one_step"},
                 {"mode": "fully_async", "partial_rollout": False}):
        r = recipe_from_dict({"async": spec, "algorithm": {"old_logprob": "interrupt"}})
        assert r.algorithm.old_is_exact and r.partial_interrupt is None


def test_old_logprobs_survive_the_json_round_trip():
    s = Sample(group_id=3, sample_index=1, prompt_id="p", prompt_ids=[1, 5], response_ids=[7, 8, 2],
               rollout_log_probs=[-0.5, -1.25, -0.125], token_versions=[4, 5, 5],
               loss_mask=[1, 0, 1], reward=1.0, old_log_probs=[-0.5, 0.0, -math.inf])
    back = Sample.from_json(s.to_json())
    assert back.old_log_probs == [-0.5, 0.0, -math.inf]
    legacy = {k: v for k, v in s.to_json().items() if k != "old_log_probs"}  # written before
    assert Sample.from_json(legacy).old_log_probs == []


def test_a_sync_waits_for_requests_that_reached_a_paused_engine(tiny_ckpt):
    """A request still on its way when the engines paused is queued there, not aborted: the
    sync repeats the abort until it has come back (with whatever tokens it has)."""
    from training.runtime.rollouter import _Response

    rollouter = Rollouter(_recipe(tiny_ckpt), ["http://127.0.0.1:9"], SampleBuffer("fifo", 4),
                          weights_path=str(tiny_ckpt))
    late = _Response(prompt_len=2, sent=1)

    class Engines:  # the control client: the second abort reaches the queued request
        aborts = 0

        async def abort(self):
            self.aborts += 1
            if self.aborts == 2:
                late.returned = 1

    rollouter.control = Engines()
    rollouter._live[(0, 0)] = late
    asyncio.run(rollouter._await_interrupted())
    assert late.returned == 1 and rollouter.control.aborts == 2
