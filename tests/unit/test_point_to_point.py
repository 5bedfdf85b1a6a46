"""Which devices' tensors a process group sends point to point, by its backend: an exchange
moves a tensor on any other device to one of those first (``Comm.exchange``)."""

from __future__ import annotations

import pytest

from layoutckpt.torch._dist import carriers


@pytest.mark.parametrize(
    ("backend", "devices"),
    [
        ("gloo", {"cpu"}),  # gloo reads a GPU tensor's address as host memory
        ("nccl", {"cuda"}),
        ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
        ("cuda:nccl,cpu:gloo", {"cpu", "cuda"}),
        ("cpu:gloo,cuda:gloo", {"cpu"}),
        ("mpi", {"cpu"}),
    ],
)
def test_a_backend_carries_the_tensors_of_its_own_devices(backend, devices):
    assert carriers(backend) == devices


def test_an_unknown_backend_is_trusted_with_every_device():
    assert carriers("xccl") is None
    assert carriers("cpu:custom,cuda:nccl") is None
