"""Ctrl-C during `asyncrl train`: a clean stop (exit 130, resume hint), no engine server or Ray
process left behind, and the run resumes from its checkpoint. While it runs, a second
`asyncrl train --resume` of the same run directory is refused in one line naming the owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # asyncrl train interrupted and resumed (≈1.3 min)

RECIPE = {
    "name": "interrupt", "steps": 40,
    "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32, "num_layers": 2},
    "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 24},
    "engines": {"num_rollout_engines": 2},
    "async": {"mode": "one_step"},
    "eval": {"every": 0, "n": 0},
}


def _pids_matching(text: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            out.append(int(pid))
    return out


def _step_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.strip() and '"step/eval_only"' not in line)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_ctrl_c_stops_cleanly_and_resumes(tmp_path):
    home = tmp_path / "home"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    run_dir = tmp_path / "run"
    env = {**os.environ, "ASYNCRL_HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
    raylets_before = len(_pids_matching("raylet"))
    cmd = [sys.executable, "-m", "ui.cli", "train", str(recipe), "--out", str(run_dir),
           "--checkpoint-every", "2"]
    # a terminal's shell: SIGINT at its default even if this test runs with it ignored (e.g. as a
    # background job, whose children inherit SIG_IGN and would rightly keep ignoring Ctrl-C)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=Path(__file__).resolve().parents[2],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while _step_lines(run_dir / "metrics.jsonl") < 3 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.2)
        assert _step_lines(run_dir / "metrics.jsonl") >= 3, "training did not start in time"
        assert _pids_matching(str(home)), "expected engine servers serving from the state dir"
        # a second terminal resuming the live run is refused, in one line naming the owner
        second = subprocess.run([sys.executable, "-m", "ui.cli", "train", str(recipe),
                                 "--resume", str(run_dir)], env=env, capture_output=True,
                                text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
        assert second.returncode == 1, second.stdout + second.stderr
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
        assert f"is in use by asyncrl PID {proc.pid} on " in second.stderr, second.stderr
        assert proc.poll() is None  # the owner was not disturbed
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err.decode()[-2000:]
    text = out.decode() + err.decode()
    assert "resume with: asyncrl train" in " ".join(text.split())  # rich may wrap the line
    assert "Traceback" not in text
    time.sleep(1.0)
    assert _pids_matching(str(home)) == []  # engine servers gone (they serve from the state dir)
    assert len(_pids_matching("raylet")) <= raylets_before  # Ray shut down
    # the run continues from its checkpoint to the end
    state = json.loads((run_dir / "checkpoint" / "runtime.json").read_text())
    assert state["step"] >= 2
    res = subprocess.run([sys.executable, "-m", "ui.cli", "train", str(recipe), "--resume",
                          str(run_dir), "--steps", str(state["step"] + 2)], env=env,
                         capture_output=True, timeout=240,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if not r.get("step/eval_only")]
    assert steps == list(range(state["step"] + 2))
