import pytest
from typer.testing import CliRunner

from training.engines.hf_io import load_hf_dir
from ui.cli import app

runner = CliRunner()
TINY = ["--steps", "2", "--batch-size", "4", "--eval-n", "8", "--task-arg", "max_k=2"]


pytestmark = pytest.mark.usefixtures("fresh_home")


def one_line_error(res, fragment):
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("error: ") and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert isinstance(res.exception, SystemExit)  # no traceback


def test_warmstart_trains_then_hits_the_cache(tmp_path):
    res = runner.invoke(app, ["warmstart", "sum_digits", "--out", str(tmp_path / "a"), *TINY],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "greedy accuracy on the eval split" in res.stdout and "trained in" in res.stdout
    assert load_hf_dir(tmp_path / "a").meta["config"]["steps"] == 2
    res = runner.invoke(app, ["warmstart", "sum_digits", "--out", str(tmp_path / "b"), *TINY],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "cache hit" in res.stdout
    res = runner.invoke(app, ["warmstart", "sum_digits", "--out", str(tmp_path / "b"), *TINY,
                              "--no-cache"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "trained in" in res.stdout


def test_unknown_task(tmp_path):
    res = runner.invoke(app, ["warmstart", "sum_digitz", "--out", str(tmp_path / "o")])
    one_line_error(res, "unknown task 'sum_digitz'; valid names: calc_chain, jsonl, sum_digits")


def test_unwritable_or_bad_out(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    one_line_error(runner.invoke(app, ["warmstart", "sum_digits", "--out", str(blocker)]),
                   "is a file")
    one_line_error(runner.invoke(app, ["warmstart", "sum_digits", "--out",
                                       str(blocker / "ckpt")]), "cannot write --out")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("keep me")
    one_line_error(runner.invoke(app, ["warmstart", "sum_digits", "--out",
                                       str(tmp_path / "docs"), *TINY]), "not a checkpoint")


def test_bad_task_arguments(tmp_path):
    out = ["--out", str(tmp_path / "o")]
    one_line_error(runner.invoke(app, ["warmstart", "sum_digits", *out, "--task-arg", "max_k"]),
                   "must look like KEY=VALUE")
    one_line_error(runner.invoke(app, ["warmstart", "sum_digits", *out, "--task-arg", "max_k=99"]),
                   "max_k <= 16")
    one_line_error(runner.invoke(app, ["warmstart", "sum_digits", *out, "--task-arg", "colour=1"]),
                   "colour")
    one_line_error(runner.invoke(app, ["warmstart", "jsonl", *out, "--task-arg",
                                       f"path={tmp_path / 'missing.jsonl'}"]), "no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{oops}\n')
    one_line_error(runner.invoke(app, ["warmstart", "jsonl", *out, "--task-arg", f"path={bad}"]),
                   f"{bad}:2: invalid JSON")
    one_line_error(runner.invoke(app, ["warmstart", "sum_digits", *out, "--moe-experts", "2",
                                       "--moe-top-k", "3"]), "moe_top_k")
