from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.support.multirank import RankPool

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def ranks() -> RankPool:
    """Four real gloo ranks; ``ranks.run(fn, k, ...)`` runs ``fn`` as a job of ``k`` ranks."""
    pool = RankPool(4)
    yield pool
    pool.close()
