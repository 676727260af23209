"""Suite-wide settings.

Hypothesis runs derandomized: the same examples on every run, so CI is reproducible (a failure
reproduces locally with the same command). Set ``HYPOTHESIS_PROFILE=explore`` to draw fresh
random examples when hunting for bugs.
"""

import os

from hypothesis import settings

settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config):
    """Keep test state out of the working tree: unless the caller set ASYNCRL_HOME, every test
    that does not choose its own state directory shares one temporary directory."""
    import tempfile

    if "ASYNCRL_HOME" not in os.environ:
        os.environ["ASYNCRL_HOME"] = tempfile.mkdtemp(prefix="asyncrl-test-home-")
