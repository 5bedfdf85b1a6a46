"""Public signatures spell defaults as literals (the API page shows them), in step with the constants."""

from __future__ import annotations

import inspect

import pytest

import layoutckpt as lc
from layoutckpt.storage import _store


def _takes_concurrency() -> list:
    functions = [lc.save, lc.save_async, lc.load, lc.load_async, lc.open, lc.Reader]
    try:
        import layoutckpt.jax as lcj
    except ImportError:  # the jax extra is not installed
        return functions
    return [*functions, lcj.load, lcj.load_array]


@pytest.mark.parametrize("function", _takes_concurrency(), ids=lambda f: f"{f.__module__}.{f.__qualname__}")
def test_concurrency_default_is_the_store_default(function):
    parameter = inspect.signature(function).parameters["concurrency"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default == _store.DEFAULT_CONCURRENCY
