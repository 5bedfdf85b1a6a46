"""Every hostile checkpoint of the corpus (``hostile.py``) meets the verb it targets and ends
as the typed error (or the ``verify`` finding) it must, within seconds and a bounded amount of
allocated memory: no hang, no read of what lies outside the checkpoint, no silent wrong data."""

from __future__ import annotations

import contextlib
import signal
import tracemalloc
from collections.abc import Iterator

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


@pytest.mark.parametrize("attack", [_case(a) for a in CORPUS])
def test_attack_is_refused(attack: Attack, tmp_path) -> None:
    path = attack.make(tmp_path)
    tracemalloc.start()
    try:
        with deadline(SECONDS):
            if attack.error is None:
                _run(attack, path)
            else:
                with pytest.raises(attack.error, match=attack.match) as info:
                    _run(attack, path)
                # The message names what is damaged: the array, or the checkpoint's file.
                assert "model.w" in str(info.value) or "'w'" in str(info.value) or str(path) in str(info.value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"{attack.name}: {peak} bytes allocated"


def test_corpus_names_are_unique() -> None:
    names = [a.name for a in CORPUS]
    assert len(names) == len(set(names)) and len(names) >= 30
