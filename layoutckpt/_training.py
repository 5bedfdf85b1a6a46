"""Model and optimizer state in one call, through ``torch.distributed.checkpoint.state_dict``.

``get_state_dict`` already does the hard parts the same way for every parallelism: it keys the
optimizer's state by fully-qualified parameter names (not by the optimizer's integer ids, which
change when the model is wrapped differently), hands FSDP2 and tensor-parallel parameters over
as DTensors, and creates the optimizer's state when a fresh optimizer has none yet, which gives a
freshly parallelized model a complete template to load into (the optimizer is given back its
empty state). What is left here is to store that tree and to give it back.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import attrs

from ._load import load, split_by_rank
from ._reader import Reader
from .base._arguments import check_model_arguments
from .base._errors import TemplateMismatchError
from .layout._layout import Layout
from .layout._names import to_global
from .layout._tree import decode_value, flatten, leaf_nodes, unflatten
from .torch._dist import comm_for, failing_together, told


def _optimizers(optimizer: Any) -> tuple[Any, ...]:
    if optimizer is None:
        return ()
    return tuple(optimizer) if isinstance(optimizer, list | tuple) else (optimizer,)


def get_state(model: Any, optimizer: Any = None, *, options: Any = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of a (possibly FSDP2 / tensor-parallel) model and optimizer.

    Keys are fully-qualified parameter names; sharded parameters and optimizer moments are
    DTensors, so ``lc.save(path, state)`` needs no layout. ``optimizer`` may be one optimizer,
    a list of them, or None (model only). ``options`` is a ``StateDictOptions``.

    An optimizer that has not stepped yet gets a state made for the tree (its moments' shapes
    and shardings, a template to load into), but keeps none itself: ``get_state_dict`` makes it
    with a step at learning rate 0, which AdamW would count as a step of the run. Its
    parameters' gradients (a backward before restoring) are set aside meanwhile: torch makes
    no state for an optimizer whose parameters hold one, and the template would lack it.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    check_model_arguments("get_state", model, optimizer)
    optims = _optimizers(optimizer)
    if not optims:
        return {"model": get_model_state_dict(model, options=options)}
    fresh = [o for o in optims if not o.state]
    grads = {id(p): (p, p.grad) for o in fresh for g in o.param_groups for p in g["params"] if p.grad is not None}
    for p, _ in grads.values():
        p.grad = None
    try:
        model_state, optim_state = get_state_dict(model, optims, options=options)
    finally:
        for p, grad in grads.values():
            p.grad = grad
        for o in fresh:
            o.state.clear()
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


def _unexpected_text(path: str, unexpected: list[str]) -> str:
    """What a checkpoint holds that this model (or its optimizer) lacks, and what to do."""
    optim = [n for n in unexpected if n.startswith("optim.")]
    model = [n for n in unexpected if not n.startswith("optim.")]
    parts = []
    if model:
        parts.append(f"arrays the model lacks, e.g. {model[:5]}")
    if optim:
        parts.append(
            f"optimizer state of parameters or param groups the optimizer lacks, e.g. {optim[:5]} (build the "
            "optimizer with the param groups it was saved with, add_param_group included, before loading)"
        )
    return f"checkpoint {path!r} holds {'; and '.join(parts)}; pass strict=False to ignore them (their state is then dropped)"


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
    unstepped: bool = False  # the optimizer has parameters whose state the checkpoint lacks (not stepped)


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
    check_model_arguments("load_state", model, optimizer, path)
    template = get_state(model, optimizer, options=options)

    def read(like: Any) -> Any:
        return load(path, layout, like=like, strict=False, group=group)

    return restore_state(
        path, model, optimizer, template, read, strict=strict, options=options, layout=layout, group=group
    )


@attrs.frozen
class NameMap:
    """How this rank's names are stored under a load's layout: through its name rules (a
    pipeline stage's local layer numbers), and whether this rank's model is all of the stored
    one, or a part of it (stage axes, or name rules: the other ranks hold the rest)."""

    rules: tuple[Any, ...] = ()
    coords: Any = None
    whole: bool = True

    @classmethod
    def of(cls, layout: Layout | None, rank: int) -> NameMap:
        if layout is None or not (layout.names or layout.stage_axes):
            return cls()
        return cls(tuple(layout.names), layout.mesh.coords(rank), whole=False)

    def stored(self, names: list[str]) -> dict[str, str]:
        """{name in this rank's state: its stored name}."""
        return to_global(self.rules, names, self.coords) if self.rules else {n: n for n in names}


def restore_state(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any,
    template: dict[str, Any],
    read: Callable[[Any], Any],
    *,
    strict: bool,
    options: Any,
    layout: Layout | None,
    group: Any,
) -> LoadStateResult:
    """``load_state`` given the model's ``get_state`` already (``template``), its arrays read
    into a template by ``read`` (a manager reads a fast-tier piece its own way, of this rank's
    own names: ``layout`` None). Where the ranks load different parts (``split_by_rank``), a
    plan refused on one rank is refused on every rank of ``group`` before any rank reads: the
    others would wait for it in the load."""
    comm = comm_for(group)
    refused = told("load_state was refused on other ranks, so no rank loads")
    with failing_together(comm, refused, when=comm.world > 1 and split_by_rank(layout, template)):
        with Reader(path) as rd:
            where, step = rd.path, rd.step
            plan = _plan(template, rd, strict, bool(_optimizers(optimizer)), NameMap.of(layout, comm.rank))
    if plan.warning is not None:
        warnings.warn(plan.warning, UserWarning, stacklevel=3)  # the caller of load_state
    state = read(plan.like)
    model_state = state["model"] if plan.nested else state
    # Torch refuses a model lacking entries, or an optimizer lacking a parameter's state, which
    # the plan has allowed: the one under strict=False, the other for parameters never stepped.
    lenient = _lenient(options) if plan.unstepped or any(n.startswith("model.") for n in plan.missing) else options
    if plan.optimizer:
        set_state(model, optimizer, state, options=lenient)
    else:
        set_state(model, None, {"model": model_state}, options=lenient)
    restored = ("model", "optimizer") if plan.optimizer else ("model",)
    return LoadStateResult(where, step, restored, plan.missing, plan.unexpected)


def _plan(template: dict[str, Any], rd: Reader, strict: bool, with_optimizer: bool, names: NameMap) -> _Plan:
    """What to load of the checkpoint ``rd`` into ``template`` (``get_state``'s tree), checked
    before anything is read or changed. Names are compared as stored (``names``)."""
    stored = set(rd.keys()) | set(rd.value_keys()) | set(rd.aliases)
    model = template["model"]
    leaves = {k: _leaf_names(k, model[k]) for k in model}
    optim_names = [f"optim.{n}" for n in flatten(template.get("optim", {}))[1]]
    as_nested = names.stored([f"model.{n}" for ns in leaves.values() for n in ns] + optim_names)
    as_plain = names.stored([n for ns in leaves.values() for n in ns])
    nested = _is_nested(leaves, stored, rd.path, as_nested, as_plain)
    name, prefix = (as_nested, "model.") if nested else (as_plain, "")
    absent = [k for k in model if not all(name[prefix + n] in stored for n in leaves[k])]
    if absent and strict:
        raise TemplateMismatchError(
            f"checkpoint {rd.path!r} lacks {len(absent)} of the model's {len(model)} entries, e.g. "
            f"{absent[:5]}; pass strict=False to restore the rest"
        )
    kept = {k: v for k, v in model.items() if k not in absent}
    held = stored if nested else set()  # a plain state_dict holds no optimizer state
    optim = _stepped_only(_with_stored_groups(template["optim"], rd), held, name) if with_optimizer else {}
    lacking, warning = _optimizer_part(optim, stored, name, nested, strict, rd.path) if with_optimizer else ([], None)
    optimizer = with_optimizer and not lacking
    like: Any = kept
    if nested:
        like = {"model": kept, "optim": optim} if optimizer else {"model": kept}
    unexpected = _unexpected(rd, like, name, nested, optimizer) if names.whole else []
    if unexpected and strict:
        raise TemplateMismatchError(_unexpected_text(rd.path, unexpected))
    missing = tuple(f"model.{k}" for k in absent) + tuple(lacking)
    unstepped = optimizer and _state_leaves(optim) < _state_leaves(template["optim"])
    return _Plan(like, nested, optimizer, missing, tuple(unexpected), warning, unstepped)


def _unexpected(rd: Reader, like: Any, name: dict[str, str], nested: bool, optimizer: bool) -> list[str]:
    """The stored arrays the model (and a restored optimizer) could have taken but do not: in a
    checkpoint of ``get_state``, those under ``model.`` (and ``optim.``); other entries (a data
    loader's position, say) are the caller's, as is optimizer state nobody asked for. Only
    where this rank's model is the whole stored one: a pipeline stage's is a part of it."""
    used = {rd.aliases.get(name.get(n, n), name.get(n, n)) for n in flatten(like)[1]}
    ours = ("model.", "optim.") if optimizer else ("model.",)
    return [a for a in rd.keys() if a not in used and (not nested or a.startswith(ours))]


def _state_leaves(optim: dict[str, Any]) -> int:
    """How many leaves of ``optim`` (nested or flattened) are per-parameter state."""
    return sum(n.startswith("state.") for n in flatten(optim)[1])


def _with_stored_groups(optim: dict[str, Any], rd: Reader) -> dict[str, Any]:
    """The optimizer's template with its ``param_groups`` as the checkpoint stores them, where
    both hold them as a list (each group naming its parameters): ``set_state_dict`` matches the
    groups to the optimizer's by those names, so a new optimizer may list its groups in another
    order or with other sizes, where matching by position would not fit."""
    node = _child(rd.meta.tree, "optim", "param_groups")
    if not isinstance(optim.get("param_groups"), list) or node is None or "list" not in node:
        return optim
    if any("array" in leaf for _, leaf in leaf_nodes(node)):
        return optim  # a hyper-parameter stored as a tensor: the template's groups, by position
    return {**optim, "param_groups": unflatten(node, lambda _, leaf: decode_value(leaf))}


def _child(tree: Any, *keys: str) -> Any:
    """The node at ``keys`` of a stored tree (dict nodes), or None."""
    node = tree
    for key in keys:
        node = dict(node["dict"]).get(key) if isinstance(node, dict) and "dict" in node else None
        if node is None:
            return None
    return node


def _stepped_only(optim: dict[str, Any], stored: set[str], name: dict[str, str]) -> dict[str, Any]:
    """The optimizer's template less the state of the parameters the checkpoint holds none of:
    the saved optimizer had not stepped them (an unused module, an expert no token reached),
    and ``get_state`` saves no state for those. ``name``: a name in the state -> as stored."""
    if isinstance(optim.get("state"), dict):
        state = {
            fqn: kv
            for fqn, kv in optim["state"].items()
            if any(name.get(n, n) in stored for n in flatten({"optim": {"state": {fqn: kv}}})[1])
        }
        return {**optim, "state": state}
    held = {
        k.rsplit(".", 1)[0] for k in optim if k.startswith("state.") and name.get(f"optim.{k}", f"optim.{k}") in stored
    }
    return {k: v for k, v in optim.items() if not k.startswith("state.") or k.rsplit(".", 1)[0] in held}


def _optimizer_part(
    optim: dict[str, Any], stored: set[str], name: dict[str, str], nested: bool, strict: bool, where: str
) -> tuple[list[str], str | None]:
    """The optimizer's names the checkpoint lacks (it is restored whole or not at all), and the
    warning to give when it is not restored; part of it stored raises under ``strict``. A plain
    state dict (not ``nested``) holds no optimizer state."""
    _, leaves = flatten(optim)
    lacking = [f"optim.{n}" for n in leaves if not (nested and name.get(f"optim.{n}", f"optim.{n}") in stored)]
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


def _is_nested(
    leaves: dict[str, list[str]], stored: set[str], where: str, as_nested: dict[str, str], as_plain: dict[str, str]
) -> bool:
    """Whether the checkpoint holds the model under ``model.`` (saved from ``get_state``) or at
    its top (a plain ``state_dict()``): the reading under which more of the model's entries
    exist. A plain state dict of a model that has a ``model`` submodule (Hugging Face's
    ``LlamaForCausalLM``) names ``model.layers...``, which only the plain reading finds."""
    nested = sum(all(as_nested[f"model.{n}"] in stored for n in ns) for ns in leaves.values())
    plain = sum(all(as_plain[n] in stored for n in ns) for ns in leaves.values())
    if leaves and not nested and not plain:
        raise TemplateMismatchError(
            f"checkpoint {where!r} holds none of the model's {len(leaves)} parameters and buffers, neither "
            f"under 'model.' (as saved from lc.get_state) nor at its top (a plain state_dict): the model "
            f"has e.g. {list(leaves)[:3]}, the checkpoint {sorted(stored)[:3]}; was it saved from another model?"
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
