"""Every verb takes its I/O knobs as one ``io=`` value; the sync and async verbs share one set
of keywords, declared once, and an unknown keyword is refused with the ones a verb takes."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import layoutckpt as lc
from layoutckpt.base._options import (
    DEFAULT_IO,
    LoadKeywords,
    LoadOptions,
    SaveAsyncKeywords,
    SaveKeywords,
    SaveOptions,
    io_config,
)


def _explicit() -> list:
    functions = [lc.open, lc.Reader, lc.CheckpointManager]
    try:
        import layoutckpt.jax as lcj
    except ImportError:  # the jax extra is not installed
        return functions
    return [*functions, lcj.load, lcj.load_array]


@pytest.mark.parametrize("function", _explicit(), ids=lambda f: f"{f.__module__}.{f.__qualname__}")
def test_verbs_with_their_own_signature_take_io_keyword_only_defaulting_to_none(function):
    parameter = inspect.signature(function).parameters["io"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default is None


@pytest.mark.parametrize(
    ("function", "keywords"),
    [
        (lc.save, SaveKeywords),
        (lc.save_async, SaveAsyncKeywords),
        (lc.load, LoadKeywords),
        (lc.load_async, LoadKeywords),
    ],
)
def test_sync_and_async_verbs_share_one_declaration_of_their_keywords(function, keywords):
    options = inspect.signature(function).parameters["options"]
    assert options.kind is inspect.Parameter.VAR_KEYWORD
    assert "io" in keywords.__annotations__
    # Every keyword is a field of the options value the verb builds, with its default.
    fields = SaveOptions.__attrs_attrs__ if keywords is not LoadKeywords else LoadOptions.__attrs_attrs__
    assert set(keywords.__annotations__) <= {f.name for f in fields}


def test_unknown_keywords_are_refused_with_what_the_verb_takes(tmp_path):
    with pytest.raises(TypeError, match=r"save\(\) got an unexpected keyword argument 'lazy'; it takes step, "):
        lc.save(tmp_path / "a", {"x": np.arange(2)}, lazy=True)  # save_async's keyword
    with pytest.raises(TypeError, match=r"load\(\) got an unexpected keyword argument 'concurrency'; .* io"):
        lc.load(tmp_path / "a", concurrency=4)
    assert not (tmp_path / "a").exists()


def test_io_none_means_the_defaults_and_anything_else_is_refused():
    assert io_config(None) is DEFAULT_IO == lc.IOConfig()
    assert SaveOptions(io=None).io is DEFAULT_IO and LoadOptions(io=None).io is DEFAULT_IO
    with pytest.raises(TypeError, match=r"io= takes an lc\.IOConfig, got dict"):
        io_config({"concurrency": 8})
    with pytest.raises(ValueError, match=r"IOConfig\.threads must be a positive int, got 0"):
        lc.IOConfig(threads=0)
