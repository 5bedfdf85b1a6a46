"""What every crash test module shares: a fork server of rank processes with torch imported."""

from __future__ import annotations

import pytest

from tests.support import crash_harness as ch


@pytest.fixture(scope="module")
def server():
    fs = ch.ForkServer()
    yield fs
    fs.close()
