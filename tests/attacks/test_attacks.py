"""Every hostile checkpoint of the corpus (``hostile.py``) meets the verb it targets and ends
as the typed error (or the ``verify`` finding) it must, within seconds and a bounded amount of
memory: no hang, no read of what lies outside the checkpoint, no silent wrong data.

Memory is the growth of the process's peak resident set (``VmHWM``, reset before each attack),
which sees TensorStore's allocations too. ``tracemalloc`` is not used: on Python 3.11 it crashes
when a TensorStore thread enters Python (a future's callback) while it traces."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import layoutckpt as lc
from layoutckpt._verify import verify

from .hostile import CORPUS, Attack

SECONDS = 20
# Far below the 1 GiB that each bomb and each petabyte shape would take if they were believed.
PEAK_BYTES = 64 << 20


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail with ``TimeoutError`` after ``seconds``: a blocked open or read is interrupted."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s: the attack hangs the reader")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(a: Attack, path) -> None:
    if a.verb == "open":
        lc.open(path).close()
    elif a.verb == "load":
        lc.load(path)
    elif a.verb == "load_rank_state":
        lc.load_rank_state(path)
    elif a.verb == "open_read":
        with lc.open(path) as rd:
            rd.read("model.w")
    else:
        with lc.open(path) as rd:
            found = verify(rd)
        texts = [p.text for p in found.problems]
        assert not found.ok and any(a.match in t for t in texts), texts


def _case(a: Attack) -> object:
    marks = [pytest.mark.xfail(reason=a.gap, strict=True)] if a.gap else []
    return pytest.param(a, id=a.name, marks=marks)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


@pytest.mark.parametrize("attack", [_case(a) for a in CORPUS])
def test_attack_is_refused(attack: Attack, tmp_path) -> None:
    path = attack.make(tmp_path)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    before = _status_kb("VmRSS")
    with deadline(SECONDS):
        if attack.error is None:
            _run(attack, path)
        else:
            with pytest.raises(attack.error, match=attack.match) as info:
                _run(attack, path)
            # The message names what is damaged: the array, or the checkpoint's file.
            assert "model.w" in str(info.value) or "'w'" in str(info.value) or str(path) in str(info.value)
    grown = (_status_kb("VmHWM") - before) << 10
    assert grown < PEAK_BYTES, f"{attack.name}: the resident set grew by {grown} bytes"


def test_corpus_names_are_unique() -> None:
    names = [a.name for a in CORPUS]
    assert len(names) == len(set(names)) and len(names) >= 30
