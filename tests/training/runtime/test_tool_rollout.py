"""The agent loop of the rollouter on a real server: multi-turn tool trajectories under partial
rollout, checked token by token.

The Rollouter (in-process, no Ray) generates calc_chain trajectories on a real fp32 embedded
server while the test pushes new trainer weights six to twelve times with ``sync_weights``
(pause, load, continue). Turns stop at the call's closing ``]``; the tool (here a calculator that
sleeps on some calls, so that some calls time out) answers with an observation the rollouter
appends with loss mask 0. Under ``old_logprob: snapshot`` the Learner's π_old must equal the
trainer's log-probs at each token's version, and — fp32 server — the log-probs μ the server
reported: that holds for the tokens after a tool observation and after a resume only if the
per-token versions are right across turns and interruptions. The tool's tokens must never reach
the loss.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest
import torch

from training.engines.embedded.launch import EmbeddedServer
from training.engines.embedded.trainer import EmbeddedTrainEngine
from training.engines.train import OptimConfig, TokenBatch
from training.engines.warmstart import WarmStartConfig, warm_start
from training.recipe import recipe_from_dict
from training.runtime.actors import SampleBuffer
from training.runtime.learner import Learner
from training.runtime.rollouter import Rollouter
from training.tasks.registry import get_task
from training.tasks.tokenizer import CharTokenizer
from training.tasks.tools import TOOLS, calc

_CALLS = itertools.count()


@TOOLS.register("test_slow_calc")
def slow_calc(argument: str) -> str:
    """calc, but every other call (the 1st, 3rd, ...) takes 2 s (past the test's 0.2 s limit).
    By count, not by argument: a warm start whose calls all had even-length arguments once left
    a run without a single timeout (seen in a CI-like run of the new warm start)."""
    if next(_CALLS) % 2 == 0:
        time.sleep(2)
    return calc(argument)


@pytest.fixture(scope="module")
def tool_ckpt(module_home):
    """A tiny calc_chain warm start (it has seen the call format a little)."""
    return warm_start(WarmStartConfig(task="calc_chain", steps=200, hidden_size=32,
                                      num_layers=2, eval_n=8)).path


async def _until_decoding(url: str) -> None:
    """Wait until the server is decoding (running sequences that already have output)."""
    async with httpx.AsyncClient() as http:
        for _ in range(2000):
            state = (await http.get(url + "/server_info")).json()["internal_states"][0]
            if state["running"] > 0 and state["generated_tokens"] > 0:
                return
            await asyncio.sleep(0.002)


def _nudge(engine: EmbeddedTrainEngine) -> None:
    batch = TokenBatch.from_sequences([[1, 10, 11]] * 2, [[12, 13, 2], [14, 2]])
    old = engine.compute_log_probs(batch).log_probs
    engine.train_step(batch, torch.ones_like(old), old)


@pytest.mark.slow
@pytest.mark.parametrize("interrupt", ["retract", "abort_resume"])
def test_tool_trajectories_across_syncs(tool_ckpt, tmp_path, interrupt):
    recipe = recipe_from_dict({
        "steps": 4,
        "model": {"kind": "checkpoint", "path": str(tool_ckpt)},
        "task": {"name": "calc_chain", "args": {"tool": "test_slow_calc"}},
        "rollout": {"n": 2, "batch_prompts": 4, "temperature": 1.5, "max_response_tokens": 120,
                    "max_turns": 4, "tool_timeout_s": 0.2},
        "async": {"mode": "fully_async", "staleness_threshold": 1.0, "partial_rollout": True,
                  "interrupt": interrupt},
        "data": {"drain": "fifo", "dispatch": "fifo", "max_in_flight": 4},
        "algorithm": {"old_logprob": "snapshot", "correction": {"kind": "compis"}},
    })
    engine = EmbeddedTrainEngine.from_pretrained(tool_ckpt, optim=OptimConfig(lr=1e-3))
    v0 = engine.weight_version
    with EmbeddedServer(tool_ckpt, dtype="fp32", threads=1) as server:

        async def scenario():
            buffer = SampleBuffer("fifo", 64)
            rollouter = Rollouter(recipe, [server.url], buffer, None, version=v0)
            await rollouter.start()
            try:
                # syncs while trajectories are being generated: at least six, and on until the
                # 8 groups the test takes are complete (a loaded machine generates slowly)
                for i in range(1, 13):
                    _nudge(engine)
                    await _until_decoding(server.url)
                    path = tmp_path / f"v{engine.weight_version}"
                    engine.export_weights(path)
                    await rollouter.sync_weights(str(path), engine.weight_version, i, 0)
                    if i >= 6 and buffer.put_count >= 8:
                        break
                groups = await buffer.take(8, timeout=120)
                assert groups is not None
                return groups, await rollouter.stats()
            finally:
                await rollouter.stop()

        groups, stats = asyncio.run(scenario())
    tok = CharTokenizer()
    task = get_task("calc_chain", tool="test_slow_calc")
    samples = [s for g in groups for s in g.samples]
    multi = [s for s in samples if s.tool_calls]
    assert multi, "no trajectory made a tool call"
    statuses = set()
    for s in samples:
        n = s.response_len
        assert len(s.loss_mask) == len(s.turn_ids) == len(s.token_versions) == n
        assert s.turn_ids == sorted(s.turn_ids) and s.turns <= 4
        assert s.token_versions == sorted(s.token_versions)  # never backwards, across turns
        # every masked stretch is one observation: "{...}" right after a turn that ended in "]",
        # exactly what the tool answers for that call (a timeout: "{timeout}")
        i, observations = 0, 0
        while i < n:
            if s.loss_mask[i]:
                i += 1
                continue
            j = i
            while j < n and not s.loss_mask[j]:
                j += 1
            obs = tok.decode(s.response_ids[i:j])
            turn_start = s.turn_ids.index(s.turn_ids[i])
            call = tok.decode(s.response_ids[turn_start:i])
            assert call.endswith("]") and s.turn_ids[i] == s.turn_ids[i - 1]
            if obs == "{timeout}":
                statuses.add("timeout")
            else:
                want = task.observe(call, 5.0).observation
                assert want.startswith(obs)  # (the last may be cut at the token cap)
                statuses.add("error" if obs.startswith("{error") else "ok")
            if j < n:
                assert s.turn_ids[j] == s.turn_ids[i] + 1
            observations += 1
            i = j
        assert observations == s.tool_calls
        assert s.tool_timeouts <= s.tool_calls
    assert "timeout" in statuses, "no call timed out"
    assert stats["async/rollouter/tool_calls"] >= sum(s.tool_calls for s in samples)
    assert stats["async/rollouter/tool_timeouts"] >= 1

    learner = Learner(engine, recipe, keep_tensors=True)
    result = learner.step(groups, step=3)
    assert result.trained
    dbg = result.debug
    assert dbg is not None
    mask = dbg["response_mask"].bool()
    for i, s in enumerate(samples):  # the tool's tokens never reach the loss
        o = s.response_len
        assert mask[i, :o].int().tolist() == s.loss_mask
        assert not bool(dbg["keep_mask"][i, :o][~mask[i, :o]].any())
    versions = dbg["token_versions"]
    batch = TokenBatch.from_sequences([s.prompt_ids for s in samples],
                                      [s.response_ids for s in samples])
    post_tool = torch.zeros_like(mask)
    for i, s in enumerate(samples):
        post_tool[i, :s.response_len] = torch.tensor([t > 0 for t in s.turn_ids])
    checked_post = 0
    for v in sorted(set(versions[mask].tolist())):
        lp = engine.compute_log_probs(batch, version=int(v), temperature=1.5).log_probs
        hit = mask & (versions == v)
        torch.testing.assert_close(dbg["old_log_prob"][hit], lp[hit])
        torch.testing.assert_close(lp[hit], dbg["rollout_log_prob"][hit], atol=2e-4, rtol=0)
        checked_post += int((hit & post_tool).sum())
    assert checked_post > 0, "no post-tool token was checked"
    m = result.metrics
    assert m["tool/pre_tool/tokens"] + m["tool/post_tool/tokens"] == float(mask.sum())
    assert m["tool/post_tool/tokens"] == float((mask & post_tool).sum())
    assert "tool/post_tool/mismatch/engine/logprob_abs_diff/mean" in m
    assert m["tool/calls_per_sample"] == pytest.approx(sum(s.tool_calls for s in samples) /
                                                       len(samples))
    # partial rollout interrupted trajectories both inside a turn and between turns
    within = between = 0
    for s in multi:
        for a in range(1, s.response_len):
            if s.loss_mask[a] and s.token_versions[a] != s.token_versions[a - 1]:
                same_turn = s.turn_ids[a] == s.turn_ids[a - 1]
                within += same_turn
                between += not same_turn
    seen = f"{len(multi)} trajectories with calls, {within} cut inside a turn, {between} between"
    assert within > 0, f"no sync caught a tool trajectory mid-turn ({seen})"
    assert between > 0, f"no trajectory went on under new weights after a tool call ({seen})"
    # and the learner's own counts of it: each cut trajectory is cut inside a turn, between
    # turns, or both (the end-to-end run in test_runtime.py checks these bounds per step)
    partial = sum(s.spans_sync for s in samples)
    assert m["async/partial_samples"] == partial > 0
    cuts = m["tool/partial_within_turn"] + m["tool/partial_between_turns"]
    assert partial <= cuts <= 2 * partial and m["tool/partial_within_turn"] > 0
    if interrupt == "abort_resume":
        assert stats["async/rollouter/resumed_requests"] > 0
