"""Run-directory ownership (training.ownership): a second process is refused while the first
lives, naming its PID; a SIGKILLed owner frees the directory at once. Process identity tells a
live process from a dead or reused PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from training.ownership import OwnedError, ProcessIdentity, RunDirLock, pid_alive

HOLDER = """
import sys, time
from training.ownership import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_second_owner_refused_until_the_first_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(OwnedError) as err:
            RunDirLock(run_dir).acquire()
        msg = str(err.value)
        assert f"in use by asyncrl PID {proc.pid} on " in msg and "\n" not in msg
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunDirLock(run_dir) as lock:  # the kernel dropped the dead owner's lock
        assert ProcessIdentity.from_json((run_dir / ".owner.lock").read_text()) == lock.identity
    assert (run_dir / ".owner.lock").read_text() == ""  # released: no owner named


def test_identity_alive_dead_reused_and_remote():
    me = ProcessIdentity.current()
    assert me.alive() is True and pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert replace(me, pid=proc.pid).alive() is False
    if me.start_ticks is not None:  # Linux: a PID with another start time was reused
        assert replace(me, start_ticks=me.start_ticks + 1).alive() is False
    assert replace(me, host="elsewhere.invalid").alive() is None
    assert ProcessIdentity.from_json(me.to_json()) == me
    assert ProcessIdentity.from_json("{not json") is None
