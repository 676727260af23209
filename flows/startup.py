"""Start the services an in-process campaign flow needs side by side, before its flow run.

Measured on the 2-core machine (``benchmarks/platform_overhead.py``, cProfile of ``asyncrl
campaign launch`` in a fresh state directory): before its first training step a campaign spent,
one after the other, 20 s in Prefect's temporary API server (a subprocess that imports Prefect's
server and runs its ~100 database migrations: 18 s on a new database, 5.6 s on an existing one),
7 s starting Ray and 5.6 s creating MLflow's store (its import and migrations). The three are
independent: the API server is another process, Ray's start is mostly waiting for its own
processes, and MLflow's store is created in this one. :func:`start_services` runs them at the
same time; the flow run then finds each of them up (the API server is Prefect's own
:class:`~prefect.server.api.server.SubprocessASGIServer`, which the flow's client reuses; Ray is
joined by :func:`training.runtime.run.start_ray`, a no-op when connected; MLflow's store is
cached per URI in this process).

A Prefect API the user chose (``PREFECT_API_URL``, e.g. the server of ``asyncrl up``) is used as
it is and nothing is started for Prefect.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["start_services"]


def _needs_temporary_api() -> bool:
    from prefect.settings import PREFECT_API_URL

    return not PREFECT_API_URL.value()


def _start_temporary_api() -> None:
    # Prefect's own temporary server, started the way its client would start it; the
    # instance is shared per process, so the flow run's client finds it running
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer().start()


def _open_tracking_store(tracking_uri: str | None) -> None:
    from flows.tracking import Tracker

    Tracker(tracking_uri)  # creates (or migrates) the store; a broken URI only warns


def _spawn(job: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            job()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="asyncrl-start", daemon=True)
    thread.start()
    return thread


def start_services(tracking_uri: str | None = None, *, ray: bool = True) -> None:
    """Start Prefect's temporary API (unless ``PREFECT_API_URL`` names one), MLflow's store at
    ``tracking_uri`` (default: the state directory's) and, when ``ray``, a local Ray (or join
    ``$RAY_ADDRESS``) at the same time; return when all are up.

    Raises:
        RuntimeError: Prefect's temporary API did not start in time (Prefect's message).
        training.runtime.run.RunError: Ray could not be started or joined (one line).
    """
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []
    # every module a job needs is imported here, in this thread, before the job's thread
    # starts: two threads importing modules that import each other can see one of them
    # half-initialised. Prefect's server first: its process then starts while the rest imports.
    if _needs_temporary_api():
        import prefect.server.api.server  # noqa: F401

        threads.append(_spawn(_start_temporary_api, errors))
    import mlflow.tracking  # noqa: F401

    import flows.tracking  # noqa: F401
    from training.runtime.run import start_ray

    if ray:
        import ray as _ray  # noqa: F401
    threads.append(_spawn(lambda: _open_tracking_store(tracking_uri), errors))
    if ray:
        start_ray()  # on an error (or Ctrl-C) here the daemon threads are left to end with us
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
