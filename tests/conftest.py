"""Shared fixtures for the kvstrata test suite."""

import os

# Hypothesis: deterministic and bounded so the suite's run time is predictable on 2 cores.
from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvstrata",
    derandomize=True,
    deadline=None,
    max_examples=int(os.environ.get("KVSTRATA_HYPOTHESIS_EXAMPLES", "150")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvstrata")
