import os

from hypothesis import HealthCheck, settings

# CI runs the property tests at full strength (HYPOTHESIS_PROFILE=ci, set by .ci/run).
settings.register_profile(
    "ci",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
