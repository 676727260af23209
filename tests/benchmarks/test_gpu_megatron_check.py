"""benchmarks/gpu_megatron_check.py without a GPU: its one-line refusal, its batches, and (slow)
the whole check on the CPU with gloo."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_megatron_check",
                                                  ROOT / "benchmarks" / "gpu_megatron_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_or_megatron_it_exits_2_with_one_line(check, capsys):
    if torch.cuda.is_available() and importlib.util.find_spec("megatron") is not None:
        pytest.skip("CUDA and megatron-core are both here")
    assert check.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("gpu_megatron_check: ") and captured.err.count("\n") == 1


def test_pattern_batches_are_valid_and_fixed(check):
    a = check.pattern_batch(16, seed=5, vocab=100, bos=1, eos=2)
    b = check.pattern_batch(16, seed=5, vocab=100, bos=1, eos=2)
    assert torch.equal(a.input_ids, b.input_ids)
    assert a.batch_size == 16 and int(a.response_lens[-1]) == 0  # one empty response
    assert bool((a.input_ids[:, 0] == 1).all())
    assert int(a.input_ids.max()) < 100
    ends = a.input_ids[torch.arange(15), (a.prompt_lens + a.response_lens - 1)[:15]]
    assert bool((ends == 2).all())


def test_abs_diff_stats(check):
    a = torch.zeros(2, 3)
    b = torch.tensor([[1.0, -2.0, 9.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    s = check.abs_diff_stats(a, b, mask)
    assert s["n"] == 3 and s["max"] == 2.0 and abs(s["mean"] - 3.5 / 3) < 1e-12


@pytest.mark.slow
def test_the_whole_check_passes_on_the_cpu(check, capsys, tmp_path):
    pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")
    code = check.main(["--device", "cpu", "--steps", "2", "--sharpen-steps", "5",
                       "--bench-steps", "0", "--json", str(tmp_path / "figures.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.rstrip().endswith("verdict: OK")
    assert (tmp_path / "figures.json").is_file()
