"""A real S3-protocol server on loopback for the tests: moto's standalone server in a subprocess.

``S3Server`` starts it on a free port and waits until it answers; ``env`` holds the variables a
user would set (endpoint, region, credentials), so layoutckpt is tested the way it is configured.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # An empty AWS config: TensorStore's credential chain then stops at the variables
        # instead of logging that ~/.aws is missing on every request.
        empty = tempfile.NamedTemporaryFile(prefix="lc-aws-", delete=False)
        empty.close()
        self.env = {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_CONFIG_FILE": empty.name,
            "AWS_SHARED_CREDENTIALS_FILE": empty.name,
        }
        self._empty = empty.name
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's S3 server did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def create_bucket(self, name: str) -> None:
        # A bare PUT of the bucket: S3's CreateBucket, which moto accepts unsigned.
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        urllib.request.urlopen(req, timeout=10).close()

    def apply(self) -> None:
        os.environ.update(self.env)

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._empty)


@contextlib.contextmanager
def running(bucket: str) -> Iterator[S3Server]:
    """A server with ``bucket`` created and its variables set for this process, as a user would
    set them; the variables are put back and the server stopped afterwards."""
    server = S3Server()
    server.create_bucket(bucket)
    saved = {k: os.environ.get(k) for k in server.env}
    server.apply()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
