"""benchmarks/gpu_smoke.py without a GPU: the recipes it builds, its refusal to run here, and its
verdict on metric histories (the run itself needs SGLang and two GPUs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from training.runtime.run import RunResult
from training.runtime.sinks import JsonlSink

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [
    [], ["--moe"], ["--weight-sync", "nccl", "--precision", "bf16"],
    ["--mode", "fully_async"], ["--mode", "fully_async", "--moe"]])
def test_smoke_recipes_are_valid_and_use_both_gpu_backends(smoke, flags):
    args = smoke.parse_args(flags)
    recipe = smoke.smoke_recipe(args)
    assert recipe.engines.rollout == "sglang" and recipe.engines.train == "megatron"
    assert recipe.steps == 5 and recipe.engines.num_rollout_engines == 1
    assert recipe.engines.sglang.weight_sync == args.weight_sync
    assert recipe.engines.megatron.precision == args.precision
    assert recipe.algorithm.routing_replay == ("r3" if "--moe" in flags else "none")
    if "fully_async" in flags:  # partial rollout on SGLang: abort at a sync, then resume
        assert recipe.mode == "fully_async" and recipe.partial_interrupt == "abort_resume"
    else:
        assert recipe.mode == "one_step" and recipe.partial_interrupt is None


def test_without_sglang_it_exits_2_with_one_line(smoke, capsys):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    assert smoke.main([]) == 2
    err = capsys.readouterr().err
    assert err == ('gpu_smoke: engines.rollout: sglang needs SGLang on a GPU node; install it '
                   'with pip install -e ".[gpu]"\n')


def _result(tmp_path: Path, rows: list[dict]) -> RunResult:
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path) as sink:
        for step, row in enumerate(rows):
            sink.log(step, row)
    return RunResult(run_dir=tmp_path, final_hf=tmp_path / "final", metrics_path=path,
                     trainer_checkpoint=tmp_path / "ckpt", steps_done=len(rows))


GOOD = {"mismatch/train_rollout/logprob_abs_diff/mean": 0.012, "async/batch_rejected": 0.0,
        "async/rollouter/sample_retries": 0.0}


def test_verdict_ok(smoke, tmp_path, capsys):
    rows = [{**GOOD, "step/weight_version": v, "async/partial_samples": 2.0,
             "async/rollouter/resumed_requests": 3.0 * (v + 1)} for v in range(3)]
    assert smoke.report(_result(tmp_path, rows), 12.0) == 0
    out = capsys.readouterr().out
    assert "verdict: OK" in out and "|Δlogp| mean" in out


@pytest.mark.parametrize(("change", "reason"), [
    ({"mismatch/train_rollout/logprob_abs_diff/mean": 0.2},
     "|Δlogp| mean reached 0.200 > 0.1"),
    ({"async/rollouter/sample_retries": 4.0}, "4 samples were generated again"),
    ({"async/partial_samples": 5.0}, "15 trained samples spanned a sync but only 2 requests"),
])
def test_verdict_check_names_the_reason(smoke, tmp_path, capsys, change, reason):
    rows = [{**GOOD, "step/weight_version": v, "async/partial_samples": 0.0,
             "async/rollouter/resumed_requests": 2.0, **change} for v in range(3)]
    assert smoke.report(_result(tmp_path, rows), 12.0) == 1
    assert reason in capsys.readouterr().out
