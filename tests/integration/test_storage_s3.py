"""The storage conformance suite on a real S3-protocol server (moto, on loopback)."""

from __future__ import annotations

import uuid

import pytest

from tests.support.s3server import running
from tests.support.storage_suite import LocationTests

BUCKET = "conformance"


@pytest.fixture(scope="module")
def s3():
    with running(BUCKET) as server:
        yield server


@pytest.mark.usefixtures("s3")
class TestS3(LocationTests):
    def new_url(self) -> str:
        return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/ck"
