"""The storage conformance suite (``tests/support/storage_suite.py``) on a local directory and on
``memory://``; ``tests/integration/test_storage_s3.py`` runs it on an S3 server."""

from __future__ import annotations

import uuid

import pytest

from tests.support.storage_suite import LocationTests


class TestLocalDirectory(LocationTests):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path

    def new_url(self) -> str:
        return str(self.root / uuid.uuid4().hex[:8] / "ck")


class TestMemory(LocationTests):
    def new_url(self) -> str:
        return f"memory://conformance-{uuid.uuid4().hex[:8]}/ck"
