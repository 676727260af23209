"""Atomic rewrites under kill -9: a process rewriting a run's metrics history (the resume path,
``training.runtime.checkpoint.truncate_history``) is SIGKILLed at random moments; after every
kill the file holds the whole history. The same loop with a plain ``write_text`` loses it (the
control). A directory swap killed between its two renames is recovered."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.fileio import atomic_write_text, recover_dir, replace_dir

ROWS = 40_000  # ~4 MB of JSONL: the rewrite takes long enough to be hit


def _history(path: Path) -> str:
    text = "".join(json.dumps({"step": i, "time": 0.0, "rollout/reward_mean": i / ROWS,
                               "mismatch/logprob_abs_diff/mean": 0.001}) + "\n"
                   for i in range(ROWS))
    path.write_text(text)
    return text


REWRITER = """
import sys
from pathlib import Path
from training.runtime.checkpoint import truncate_history
path = Path(sys.argv[1])
print("ready", flush=True)
while True:
    truncate_history(path, {rows})   # keeps every row: the file is rewritten, unchanged
"""

PLAIN = """
import sys
from pathlib import Path
path = Path(sys.argv[1])
text = path.read_text()
print("ready", flush=True)
while True:
    path.write_text(text)
"""


def _kill_during_rewrites(path: Path, code: str, trials: int) -> list[str]:
    """Start ``code`` rewriting ``path``; SIGKILL it at a random moment ``trials`` times; return
    the file's content after each kill."""
    rng = random.Random(0)
    seen = []
    for _ in range(trials):
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        seen.append(path.read_text())
    return seen


@pytest.mark.slow
def test_kill_during_the_metrics_rewrite_keeps_the_whole_history(tmp_path):
    path = tmp_path / "metrics.jsonl"
    full = _history(path)
    after = _kill_during_rewrites(path, REWRITER.format(rows=ROWS), trials=8)
    assert all(text == full for text in after)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]
    assert all(name.startswith(".metrics.jsonl.tmp-") for name in leftovers)


@pytest.mark.slow
def test_control_a_plain_rewrite_loses_history_when_killed(tmp_path):
    """Why the atomic write exists: the same kills against ``write_text`` leave a cut file."""
    path = tmp_path / "metrics.jsonl"
    full = _history(path)
    after = _kill_during_rewrites(path, PLAIN, trials=12)
    assert any(text != full for text in after)


def test_atomic_write_replaces_content_and_leaves_no_temp(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_replace_dir_and_recovery_of_a_swap_killed_between_renames(tmp_path):
    target = tmp_path / "checkpoint"
    first = tmp_path / ".checkpoint.tmp"
    first.mkdir()
    (first / "runtime.json").write_text('{"step": 4}')
    replace_dir(first, target)
    assert (target / "runtime.json").read_text() == '{"step": 4}'

    second = tmp_path / ".checkpoint.tmp"
    second.mkdir()
    (second / "runtime.json").write_text('{"step": 8}')
    # a kill after the first rename of replace_dir: the old checkpoint is aside, none in place
    os.replace(target, tmp_path / ".checkpoint.old-deadbeef")
    assert not target.exists()
    assert recover_dir(target) is True
    assert (target / "runtime.json").read_text() == '{"step": 4}'  # the complete old one
    replace_dir(second, target)  # the next checkpoint goes through as usual
    assert (target / "runtime.json").read_text() == '{"step": 8}'
    assert recover_dir(target) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
