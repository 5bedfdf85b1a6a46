"""``Layout``: ordered regex rules from global array names to partition specs on a mesh.

A layout is declared in code or in a TOML file under ``specs/``. The first rule whose pattern
``re.search``-es the global name decides that array's spec.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ..base._errors import LayoutError
from ._flat import Flat
from ._names import NameRule, Rename, Renumber, check_names, parse_names
from ._spec import Mesh, P
from ._views import Fused, Padded

Spec = P | Flat | Fused | Padded
Rule = tuple[str, Spec]
# What a rule may declare for an array held by several ranks whose copies may differ.
REPLICA_POLICIES = ("check", "first", "mean")

# The keys of a [[rules]] table in a layout file; anything else is a typo, refused by name.
RULE_KEYS = ("match", "spec", "note")
_RULE_KEYS_TEXT = "'match' and 'spec' (and an optional 'note')"


def _parse_rules(rules: Iterable[tuple[str, Spec]]) -> tuple[Rule, ...]:
    if not isinstance(rules, Iterable) or isinstance(rules, str | Mapping):
        raise LayoutError(f"Layout rules must be a list of (pattern, P(...)) pairs, got {rules!r}")
    parsed: list[Rule] = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2):
            raise LayoutError(f"Layout rule #{i} must be a (pattern, P(...)) pair, got {rule!r}")
        pattern, spec = rule
        if not isinstance(pattern, str):
            raise LayoutError(f"Layout rule #{i}: the pattern must be a string, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as err:
            raise LayoutError(f"Layout rule #{i}: pattern {pattern!r} is not a valid regex: {err}") from None
        if not isinstance(spec, P | Flat | Fused | Padded):
            raise LayoutError(
                f"Layout rule #{i} ({pattern!r}): the spec must be a P(...), Flat(...), Fused(...) or Padded(...), "
                f"got {spec!r}"
            )
        parsed.append((pattern, spec))
    return tuple(parsed)


def _stage_axes(value: str | Iterable[str]) -> tuple[str, ...]:
    if not isinstance(value, str | Iterable):
        raise LayoutError(f"stages must be a mesh axis name or a tuple of distinct names, got {value!r}")
    axes = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
        raise LayoutError(f"stages must be a mesh axis name or a tuple of distinct names, got {value!r}")
    return axes


def _replicas(value: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in value:
        if not (isinstance(item, tuple | list) and len(item) == 2 and item[1] in REPLICA_POLICIES):
            raise LayoutError(
                f"replicas= takes (pattern, policy) pairs, policy one of {REPLICA_POLICIES}; got {item!r}"
            )
        try:
            re.compile(item[0])
        except (re.error, TypeError) as err:
            raise LayoutError(f"replicas= pattern {item[0]!r} is not a valid regex: {err}") from None
        out.append((item[0], item[1]))
    return tuple(out)


@attrs.frozen(repr=False)
class Layout:
    """How every array of a state is split over ``mesh``: the first matching rule wins.

    ``rules`` are (regex, spec) pairs, a spec being a ``P`` or a ``Flat``; a rule is refused
    with a ``LayoutError`` naming it when its regex is invalid or its spec names an axis the
    mesh lacks (or one axis twice).

    >>> layout = Layout(Mesh({"tp": 2}), [(r"\\.q_proj\\.weight$", P("tp", None)), (r".*", P())])
    >>> layout.spec_for("model.layers.0.q_proj.weight")
    P('tp', None)
    """

    mesh: Mesh
    rules: tuple[Rule, ...] = attrs.field(converter=_parse_rules)
    stages: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=_stage_axes)
    names: tuple[NameRule, ...] = attrs.field(default=(), kw_only=True, converter=parse_names)
    replicas: tuple[tuple[str, str], ...] = attrs.field(default=(), kw_only=True, converter=_replicas)
    _compiled: tuple[re.Pattern[str], ...] = attrs.field(init=False, eq=False, hash=False)
    # Each name's rule, once found: a load or save asks for every name several times.
    _found: dict[str, Rule | None] = attrs.field(init=False, eq=False, hash=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise LayoutError(f"Layout needs a Mesh, got {self.mesh!r}")
        check_names(self.names, self.mesh)
        for axis in self.stages:
            if axis not in self.mesh.axis_names:
                raise LayoutError(f"stages names axis {axis!r}, which {self.mesh!r} does not have")
        staged = self.stage_axes
        for pattern, spec in self.rules:
            for j, axis in enumerate(spec.axes):
                if axis in staged:
                    raise LayoutError(
                        f"Layout rule {pattern!r}: spec {spec!r} splits arrays over {axis!r}, along which the "
                        "ranks hold different arrays (a stage axis: stages= or a Renumber rule); leave it out "
                        "of the spec, or out of the stage axes"
                    )
                if axis in spec.axes[:j]:
                    raise LayoutError(
                        f"Layout rule {pattern!r}: spec {spec!r} uses axis {axis!r} twice; "
                        "name each mesh axis at most once"
                    )
                if axis not in self.mesh.axis_names:
                    raise LayoutError(
                        f"Layout rule {pattern!r}: spec {spec!r} names axis {axis!r}, which "
                        f"{self.mesh!r} does not have; use one of {list(self.mesh.axis_names)}"
                    )
        object.__setattr__(self, "_compiled", tuple(re.compile(p) for p, _ in self.rules))

    @classmethod
    def replicated(cls, mesh: Mesh | None = None) -> Layout:
        """Every array whole on every rank (the layout of a single process)."""
        return cls(mesh if mesh is not None else Mesh({}), [(r".*", P())])

    def rule_for(self, name: str) -> Rule | None:
        """The first rule (pattern, spec) whose pattern matches ``name``, or None."""
        try:
            return self._found[name]
        except KeyError:
            pass
        found = next((rule for regex, rule in zip(self._compiled, self.rules) if regex.search(name)), None)
        self._found[name] = found
        return found

    def fused_part_spec(self, name: str) -> P | None:
        """Where ``name`` is a part's stored name (``a.qkv.q.weight``, ``qkv.q``) of a leaf a
        ``Fused`` rule matches, that rule's inner ``P``, which splits the part; else None."""
        head, dot, last = name.rpartition(".")
        if not dot:
            return None
        fused, _, part = head.rpartition(".")
        whole, part = (f"{fused}.{last}", part) if fused else (head, last)
        rule = self.rule_for(whole)
        if rule is not None and isinstance(rule[1], Fused) and part in dict(rule[1].parts):
            return rule[1].spec
        return None

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """The axes whose ranks hold different names: ``stages`` and every ``Renumber``'s axis,
        in mesh order."""
        named = set(self.stages) | {r.axis for r in self.names if isinstance(r, Renumber)}
        return tuple(a for a in self.mesh.axis_names if a in named)

    def replica_policy(self, name: str) -> str | None:
        """The declared policy for copies of ``name`` held by several ranks, or None."""
        return next((policy for pattern, policy in self.replicas if re.search(pattern, name)), None)

    def spec_for(self, name: str) -> Spec:
        """The spec of the array named ``name``: that of the first rule whose pattern matches it.

        Raises ``LayoutError`` if no rule matches (end the rules with ``(r".*", P())`` to
        replicate the rest).
        """
        rule = self.rule_for(name)
        if rule is not None:
            return rule[1]
        raise LayoutError(
            f"array {name!r}: no layout rule matches it (patterns: {[p for p, _ in self.rules]}); "
            "add a rule for it, or a final catch-all rule such as (r'.*', P())"
        )

    def __repr__(self) -> str:
        rules = ", ".join(f"({p!r}, {s!r})" for p, s in self.rules)
        extra = "".join(
            f", {key}={value!r}"
            for key, value in (("stages", self.stages), ("names", list(self.names)), ("replicas", list(self.replicas)))
            if value
        )
        return f"Layout({self.mesh!r}, [{rules}]{extra})"

    @property
    def spec_rules(self) -> tuple[tuple[str, P], ...]:
        """The rules that map names to ``P`` specs (flat rules left out)."""
        return tuple((p, s) for p, s in self.rules if isinstance(s, P))

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON: ``{"mesh": [[axis, size], ...], "rules": [[pattern, spec], ...]}``.

        Each spec is a list of entries (``None``, an axis name, or a list of axis names), as a
        checkpoint's root metadata stores them. Flat rules are left out (see ``spec_rules``).
        """
        return {"mesh": self.mesh.to_json(), "rules": [[p, s.to_json()] for p, s in self.spec_rules]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Layout:
        """The layout ``to_json`` wrote; ``LayoutError`` if the mesh, a spec or a rule is invalid."""
        return cls(Mesh.from_json(data["mesh"]), [(p, P.from_json(s)) for p, s in data["rules"]])

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], mesh: Mesh | None = None) -> Layout:
        """Read rules from a TOML file (see ``specs/``); ``mesh`` overrides the file's ``[mesh]``."""
        with open(path, "rb") as f:
            try:
                doc = tomllib.load(f)
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
                raise LayoutError(f"Layout file {os.fspath(path)!r} is not valid TOML: {err}") from None
        return cls.from_toml_dict(doc, mesh, source=os.fspath(path))

    @classmethod
    def from_toml_dict(cls, doc: Mapping[str, Any], mesh: Mesh | None = None, source: str = "<toml>") -> Layout:
        """``from_file`` for a TOML document already parsed (the dict ``tomllib.loads`` returns).

        ``mesh`` overrides the document's ``[mesh]``; ``source`` names the document in error
        messages. Raises ``LayoutError`` naming the source, the rule index and what is wrong: a
        missing mesh, an unknown key in a rule, a spec that is not a ``P(...)`` literal, or an
        axis the mesh lacks.
        """
        if mesh is not None and not isinstance(mesh, Mesh):
            raise LayoutError(f"{source}: mesh= must be a Mesh, such as Mesh({{'tp': 4}}), got {type(mesh).__name__}")
        if mesh is None:
            if "mesh" not in doc:
                raise LayoutError(f"{source}: has no [mesh] table; pass mesh= to Layout.from_file")
            if not isinstance(doc["mesh"], dict):
                raise LayoutError(f"{source}: [mesh] must be a table of axis = size, such as tp = 4")
            try:
                mesh = Mesh(dict(doc["mesh"]))
            except LayoutError as err:
                raise LayoutError(f"{source}: [mesh]: {err}") from None
        axes = doc.get("axes")
        if axes is not None and not (isinstance(axes, list) and all(isinstance(a, str) for a in axes)):
            raise LayoutError(f"{source}: axes must be a list of mesh axis names, such as ['dp', 'tp']; got {axes!r}")
        if axes is not None and set(axes) != set(mesh.axis_names):
            raise LayoutError(
                f"{source}: the rules are written for mesh axes {sorted(axes)} but {mesh!r} has "
                f"{sorted(mesh.axis_names)}; pass a mesh with those axes (size 1 is fine)"
            )
        rules = doc.get("rules")
        if not isinstance(rules, list) or not rules:
            raise LayoutError(f"{source}: needs a non-empty [[rules]] array of {{match, spec}} tables")
        parsed: list[tuple[str, P]] = []
        for i, rule in enumerate(rules):
            if not isinstance(rule, dict):
                raise LayoutError(f"{source}: rule #{i} must be a table with keys {_RULE_KEYS_TEXT}, got {rule!r}")
            unknown = [key for key in rule if key not in RULE_KEYS]
            if unknown:
                guesses = {k: difflib.get_close_matches(k, RULE_KEYS, n=1) for k in unknown}
                hint = "".join(f"; did you mean {g[0]!r} for {k!r}?" for k, g in guesses.items() if g)
                raise LayoutError(
                    f"{source}: rule #{i} has unknown key(s) {', '.join(map(repr, unknown))}; "
                    f"a rule is a table with keys {_RULE_KEYS_TEXT}{hint}"
                )
            if "match" not in rule:
                raise LayoutError(f"{source}: rule #{i} lacks 'match'; a rule is a table with keys {_RULE_KEYS_TEXT}")
            parsed.append((rule["match"], parse_spec(rule.get("spec", "P()"), f"{source}: rule #{i}")))
        try:
            return cls(
                mesh,
                parsed,
                stages=doc.get("stages", ()),
                names=_toml_names(doc.get("names", [])),
                replicas=_toml_replicas(doc.get("replicas", [])),
            )
        except LayoutError as err:
            raise LayoutError(f"{source}: {err}") from None


def _tables(value: object, key: str) -> list[dict[str, Any]]:
    if not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
        raise LayoutError(f"[[{key}]] must be an array of tables, got {value!r}")
    return value


def _toml_replicas(value: object) -> list[tuple[Any, Any]]:
    """The ``[[replicas]]`` tables: ``{match = regex, policy = "check" | "first" | "mean"}``."""
    out = []
    for i, table in enumerate(_tables(value, "replicas")):
        unknown = sorted(k for k in table if k not in ("match", "policy", "note"))
        if unknown or "match" not in table or "policy" not in table:
            raise LayoutError(
                f"replicas #{i} must be {{match = '<regex>', policy = 'check' | 'first' | 'mean'}}; "
                f"got keys {sorted(table)}"
            )
        out.append((table["match"], table["policy"]))
    return out


_NAME_KEYS = {"renumber": ("renumber", "axis", "per", "starts", "note"), "rename": ("rename", "to", "note")}


def _toml_names(value: object) -> list[NameRule]:
    """The ``[[names]]`` tables: ``{renumber = regex, axis = "pp", per = 4}`` (or ``starts``) and
    ``{rename = regex, to = replacement}``."""
    out: list[NameRule] = []
    for i, table in enumerate(_tables(value, "names")):
        kind = "renumber" if "renumber" in table else "rename" if "rename" in table else None
        unknown = [k for k in table if kind is None or k not in _NAME_KEYS[kind]]
        if kind is None or unknown:
            raise LayoutError(
                f"names #{i} must be {{renumber = '<regex>', axis = '<axis>', per = N}} (or starts = [...]) "
                f"or {{rename = '<regex>', to = '<replacement>'}}; got keys {sorted(table)}"
            )
        needed = "axis" if kind == "renumber" else "to"
        if needed not in table:
            raise LayoutError(f"names #{i} ({kind} {table[kind]!r}) lacks {needed!r}")
        if kind == "renumber":
            out.append(Renumber(table["renumber"], table["axis"], table.get("per"), table.get("starts")))
        else:
            out.append(Rename(table["rename"], table["to"]))
    return out


def parse_spec(text: str, where: str = "spec") -> P | Fused | Padded:
    """Parse ``"P('tp', None)"``, ``"Fused(P('tp'), [('gate', 64), ('up', 64)])"`` or
    ``"Padded(P('tp'), 50257)"`` safely: only those calls and literals are accepted."""
    shape_hint = "must look like \"P('tp', None)\", \"Fused(P('tp'), [('q', 64), ('k', 16)], groups=2)\" or \"Padded(P('tp'), 50257)\""
    try:
        node = ast.parse(text.strip(), mode="eval").body if isinstance(text, str) else None
    except (SyntaxError, MemoryError, RecursionError):  # the last two: absurdly nested text
        node = None
    try:
        spec = _build_spec(node)
    except (ValueError, TypeError, LayoutError, MemoryError, RecursionError) as err:
        raise LayoutError(f"{where}: spec {text!r} is not valid: {err}") from None
    if spec is None:
        raise LayoutError(f"{where}: spec {text!r} {shape_hint}")
    return spec


_SPEC_CALLS: dict[str, Any] = {"P": P, "Fused": Fused, "Padded": Padded}


def _build_spec(node: ast.AST | None) -> Any:
    """The spec a parsed call builds: ``P``, ``Fused`` or ``Padded`` with literal arguments (a
    ``P(...)`` call inside the other two); None where ``node`` is anything else."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SPEC_CALLS):
        return None
    kind = node.func.id
    # ``**{...}`` has no name (``arg`` None): not a literal keyword, so not a spec.
    if (kind == "P" and node.keywords) or any(k.arg is None for k in node.keywords):
        return None

    def value(arg: ast.AST) -> Any:
        inner = _build_spec(arg) if kind != "P" else None
        return inner if inner is not None else ast.literal_eval(arg)

    args = [value(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return _SPEC_CALLS[kind](*args, **kwargs)
