"""``python tests/flows/crash_at.py POINT ARGS...``: the asyncrl CLI (``asyncrl ARGS...``) with a
hook on the campaign flow's :data:`flows.campaign.POINT_HOOKS` that SIGKILLs this process when the
flow reaches ``POINT`` — no ``finally``, no atexit: exactly a ``kill -9`` landing at a known place.
The reliability tests' fault injection; nothing of it is in the shipped code."""

import os
import signal
import sys

from flows import campaign


def _kill_at(point: str):
    def hook(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


if __name__ == "__main__":
    campaign.POINT_HOOKS.append(_kill_at(sys.argv[1]))
    from ui.cli import app

    sys.argv = ["asyncrl", *sys.argv[2:]]
    app()
