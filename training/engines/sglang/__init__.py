"""The SGLang rollout backend (``engines.rollout: sglang``): ``python -m sglang.launch_server``
processes on GPU nodes, one per :class:`~training.engines.sglang.actor.SGLangEngineActor`.

- :mod:`.launch`: the exact command line and environment of a server (pure functions);
- :mod:`.process`: a server process in its own session, stopped by PID, gone with its parent
  (:mod:`.orphan_guard`);
- :mod:`.actor`: the Ray actor that starts, watches, restarts and re-syncs one server;
- :mod:`.fleet`: a run's engines on Ray (placement group, start, optional sglang-router, stop);
- :mod:`.nccl_sync`: weight sync by NCCL broadcast from the trainer (``weight_sync: nccl``).

Nothing here imports SGLang: the servers are separate processes, so this package (and its tests)
load on a machine without the ``gpu`` extra. The HTTP client and the response decoders are shared
with the embedded backend (:mod:`training.engines.client`, :mod:`training.engines.rollout`).
"""
