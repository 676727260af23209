"""One local Ray for the SGLang-backend tests that need it (FACTS.md: start Ray once)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """Per module, shut down at its end: later modules (tests/training/runtime) start their own
    Ray, which a still-running session-wide one would make fail."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from training.ray_setup import init_ray

    init_ray(num_cpus=2)  # loopback-only, reaped with this process
    yield ray
    ray.shutdown()
