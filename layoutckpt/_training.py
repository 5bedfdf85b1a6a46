"""Model and optimizer state in one call, through ``torch.distributed.checkpoint.state_dict``.

``get_state_dict`` already does the hard parts the same way for every parallelism: it keys the
optimizer's state by fully-qualified parameter names (not by the optimizer's integer ids, which
change when the model is wrapped differently), hands FSDP2 and tensor-parallel parameters over
as DTensors, and creates the optimizer's state when a fresh optimizer has none yet, which gives a
freshly parallelized model a complete template to load into. What is left here is to store that
tree and to give it back.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import attrs

from ._load import load
from ._reader import Reader
from .base._errors import TemplateMismatchError
from .layout._layout import Layout
from .layout._tree import flatten


def _optimizers(optimizer: Any) -> tuple[Any, ...]:
    if optimizer is None:
        return ()
    return tuple(optimizer) if isinstance(optimizer, list | tuple) else (optimizer,)


def get_state(model: Any, optimizer: Any = None, *, options: Any = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of a (possibly FSDP2 / tensor-parallel) model and optimizer.

    Keys are fully-qualified parameter names; sharded parameters and optimizer moments are
    DTensors, so ``lc.save(path, state)`` needs no layout. ``optimizer`` may be one optimizer,
    a list of them, or None (model only). ``options`` is a ``StateDictOptions``.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    optims = _optimizers(optimizer)
    if not optims:
        return {"model": get_model_state_dict(model, options=options)}
    model_state, optim_state = get_state_dict(model, optims, options=options)
    return {"model": model_state, "optim": optim_state}


def set_state(model: Any, optimizer: Any, state: dict[str, Any], *, options: Any = None) -> None:
    """Put ``state`` (as ``get_state`` gives it, e.g. loaded) into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    optims = _optimizers(optimizer)
    if not optims:
        set_model_state_dict(model, state["model"], options=options)
        return
    if "optim" not in state:
        raise KeyError("the state holds no 'optim' entry; pass optimizer=None to restore the model only")
    set_state_dict(model, optims, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def _names(names: tuple[str, ...]) -> str:
    """A tuple of names for a repr: the first few, and how many more."""
    if len(names) <= 3:
        return repr(names)
    return f"({', '.join(map(repr, names[:3]))}, ... {len(names) - 3} more)"


@attrs.frozen
class LoadStateResult:
    """What ``load_state`` did: what it ``restored`` (``"model"``, ``"optimizer"``) from the
    checkpoint at ``path`` saved at ``step``; the names (as ``get_state`` gives them:
    ``model.<fqn>``, ``optim.<...>``) the model or optimizer has that the checkpoint lacks
    (``missing``), and the stored arrays nothing took (``unexpected``), as ``torch.nn.Module.
    load_state_dict`` reports its keys. Its repr shows the first few names of each.
    """

    path: str
    step: int | None
    restored: tuple[str, ...]
    missing: tuple[str, ...] = attrs.field(default=(), repr=_names)
    unexpected: tuple[str, ...] = attrs.field(default=(), repr=_names)


@attrs.frozen
class _Plan:
    """What ``load_state`` loads: the template to fill, and what it leaves out."""

    like: Any
    nested: bool
    optimizer: bool
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    warning: str | None = None


def load_state(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    layout: Layout | None = None,
    *,
    strict: bool = True,
    group: Any = None,
    options: Any = None,
) -> LoadStateResult:
    """Restore ``model`` (and ``optimizer``) from a checkpoint, resharded to the model.

    The checkpoint may be one saved from ``get_state`` (``{"model": ..., "optim": ...}``), or a
    plain ``model.state_dict()`` (names without the ``model.`` level); which one is read from
    the names it holds. The template is the model's own state: its DTensors say where every
    shard goes, whatever parallelism saved the checkpoint. With ``optimizer=None`` only the
    model is restored (the checkpoint may hold optimizer state too).

    With ``strict`` (default), as for ``torch.nn.Module.load_state_dict``, a parameter or buffer
    of the model that the checkpoint lacks, or a stored array the model lacks, raises
    ``TemplateMismatchError`` before anything is changed; ``strict=False`` restores what is
    there. A checkpoint holding no optimizer state at all (weights only) restores the model
    and warns that the optimizer keeps its own state: that is a checkpoint of another kind,
    not a damaged one, and the model is what the caller cannot do without. Part of an
    optimizer's state missing raises under ``strict``, and otherwise leaves the optimizer as
    it is, with a warning.

    Returns a ``LoadStateResult``: what was restored, the step, and the names missing.
    """
    template = get_state(model, optimizer, options=options)

    def read(like: Any) -> Any:
        return load(path, layout, like=like, strict=False, group=group)

    return restore_state(path, model, optimizer, template, read, strict=strict, options=options)


def restore_state(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any,
    template: dict[str, Any],
    read: Callable[[Any], Any],
    *,
    strict: bool,
    options: Any,
) -> LoadStateResult:
    """``load_state`` given the model's ``get_state`` already (``template``), its arrays read
    into a template by ``read``: a manager reads a fast-tier piece its own way."""
    with Reader(path) as rd:
        where, step = rd.path, rd.step
        plan = _plan(template, rd, strict, bool(_optimizers(optimizer)))
    if plan.warning is not None:
        warnings.warn(plan.warning, UserWarning, stacklevel=3)  # the caller of load_state
    state = read(plan.like)
    model_state = state["model"] if plan.nested else state
    lenient = _lenient(options) if any(n.startswith("model.") for n in plan.missing) else options
    if plan.optimizer:
        set_state(model, optimizer, state, options=lenient)
    else:
        set_state(model, None, {"model": model_state}, options=lenient)
    restored = ("model", "optimizer") if plan.optimizer else ("model",)
    return LoadStateResult(where, step, restored, plan.missing, plan.unexpected)


def _plan(template: dict[str, Any], rd: Reader, strict: bool, with_optimizer: bool) -> _Plan:
    """What to load of the checkpoint ``rd`` into ``template`` (``get_state``'s tree), checked
    before anything is read or changed."""
    stored = set(rd.keys()) | set(rd.value_keys()) | set(rd.aliases)
    model = template["model"]
    nested = _is_nested(model, stored, rd.path)
    prefix = "model." if nested else ""
    absent = [k for k in model if not all(prefix + n in stored for n in _leaf_names(k, model[k]))]
    if absent and strict:
        raise TemplateMismatchError(
            f"checkpoint {rd.path!r} lacks {len(absent)} of the model's {len(model)} entries, e.g. "
            f"{absent[:5]}; pass strict=False to restore the rest"
        )
    kept = {k: v for k, v in model.items() if k not in absent}
    lacking, warning = _optimizer_part(template, stored, nested, strict, rd.path) if with_optimizer else ([], None)
    optimizer = with_optimizer and not lacking
    like: Any = kept
    if nested:
        like = {"model": kept, "optim": template["optim"]} if optimizer else {"model": kept}
    used = {rd.aliases.get(n, n) for n in flatten(like)[1]}
    # What the model (and a restored optimizer) could have taken: in a checkpoint of
    # ``get_state``, the arrays under ``model.`` (and ``optim.``); other entries (a data
    # loader's position, say) are the caller's, as is optimizer state nobody asked for.
    ours = ("model.", "optim.") if optimizer else ("model.",)
    unexpected = [a for a in rd.keys() if a not in used and (not nested or a.startswith(ours))]
    if unexpected and strict:
        raise TemplateMismatchError(
            f"checkpoint {rd.path!r} holds arrays the model lacks, e.g. {unexpected[:5]}; "
            "pass strict=False to ignore them"
        )
    missing = tuple(f"model.{k}" for k in absent) + tuple(lacking)
    return _Plan(like, nested, optimizer, missing, tuple(unexpected), warning)


def _optimizer_part(
    template: dict[str, Any], stored: set[str], nested: bool, strict: bool, where: str
) -> tuple[list[str], str | None]:
    """The optimizer's names the checkpoint lacks (it is restored whole or not at all), and the
    warning to give when it is not restored; part of it stored raises under ``strict``."""
    _, leaves = flatten(template["optim"])
    lacking = [f"optim.{n}" for n in leaves if not (nested and f"optim.{n}" in stored)]
    if not lacking:
        return [], None
    partly = len(lacking) < len(leaves)
    if partly and strict:
        raise TemplateMismatchError(
            f"checkpoint {where!r} holds part of the optimizer's state only, lacking e.g. {lacking[:5]}; "
            "pass optimizer=None to restore the model alone, or strict=False to leave the optimizer as it is"
        )
    held = "part of the optimizer's state only" if partly else "no optimizer state"
    saved = "" if nested else " (it was saved as a plain state_dict)"
    return lacking, (
        f"checkpoint {where!r} holds {held}{saved}: the model is restored and the optimizer keeps its own "
        "state; pass optimizer=None to restore the model alone"
    )


def _is_nested(model: dict[str, Any], stored: set[str], where: str) -> bool:
    """Whether the checkpoint holds the model under ``model.`` (saved from ``get_state``) or at
    its top (a plain ``state_dict()``): the reading under which more of the model's names exist.
    A plain state dict of a model that has a ``model`` submodule (Hugging Face's
    ``LlamaForCausalLM``) names ``model.layers...``, which only the plain reading finds."""
    nested = sum(f"model.{k}" in stored for k in model)
    plain = sum(k in stored for k in model)
    if model and not nested and not plain:
        raise TemplateMismatchError(
            f"checkpoint {where!r} holds none of the model's {len(model)} parameters and buffers, neither "
            f"under 'model.' (as saved from lc.get_state) nor at its top (a plain state_dict): the model "
            f"has e.g. {list(model)[:3]}, the checkpoint {sorted(stored)[:3]}; was it saved from another model?"
        )
    return nested >= plain


def _leaf_names(key: str, value: Any) -> list[str]:
    """The stored names of one entry of a model's state dict (an extra state may be a tree)."""
    if isinstance(value, dict | list | tuple):
        return list(flatten({key: value})[1])
    return [key]


def _lenient(options: Any) -> Any:
    """``options`` (a ``StateDictOptions``, or None) with ``strict=False``, for a model restored
    in part: ``set_state_dict`` would otherwise refuse the state for lacking the rest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return dataclasses.replace(options if options is not None else StateDictOptions(), strict=False)
