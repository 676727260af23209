"""Run a command that dies with the process that started it: ``python orphan_guard.py PID -- CMD``.

SGLang's ``launch_server`` has no ``--parent-pid`` watchdog like asyncrl's embedded server, so
this stand-in sets Linux's ``PR_SET_PDEATHSIG`` (SIGTERM when the parent thread exits, for
any reason including SIGKILL) and then ``exec``s the command: the server keeps this process's
PID, so it is still stopped by PID, and the death signal survives the exec. SGLang's own
scheduler processes already die with the server (they set the same flag on themselves).

``PID`` is the parent's PID: if it is no longer this process's parent (it died between the fork
and the ``prctl``), the command is not started. Elsewhere than Linux the command just runs.
Run it by file path (not ``-m``), so it needs nothing importable.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: orphan_guard.py PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[2:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            print(f"orphan_guard: prctl failed ({os.strerror(err)})", file=sys.stderr)
            return 1
        if os.getppid() != parent:
            print(f"orphan_guard: parent {parent} is gone; not starting {cmd[0]}",
                  file=sys.stderr)
            return 1
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
