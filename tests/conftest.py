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
