"""Test configuration shared by every test module.

* Eight host CPU devices, so sharding tests have a mesh (must be set before JAX initialises).
* Hypothesis profiles: ``ci`` (default) is bounded so the suite fits in a few minutes on 2 cores, since
  every new shape costs an XLA compile; ``thorough`` runs many more examples
  (``HYPOTHESIS_PROFILE=thorough pytest tests``).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
