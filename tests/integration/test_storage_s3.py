"""The storage conformance suite on a real S3-protocol server (moto, on loopback)."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support.s3server import S3Server
from tests.support.storage_suite import LocationTests

BUCKET = "conformance"


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    server.create_bucket(BUCKET)
    saved = {k: os.environ.get(k) for k in server.env}
    server.apply()
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.usefixtures("s3")
class TestS3(LocationTests):
    def new_url(self) -> str:
        return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/ck"
