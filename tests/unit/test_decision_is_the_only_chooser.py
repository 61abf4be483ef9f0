"""A ``Reason`` is chosen in ``gateway/fencing/`` and nowhere else in the gateway.

Names are resolved, not spellings. Every module under ``gateway/`` outside ``fencing/`` is
imported and parsed; each expression in it that evaluates to a member of ``Reason`` is
found, however it is reached: ``Reason.X`` under any alias, a module-level constant of
its own or of another module (``answers.AUTO_RESOLVED``, ``fence.UNKNOWN_TOKEN``, a name
imported ``from`` one), a class attribute, ``Reason(...)``, ``Reason["X"]``,
``getattr(Reason, ...)``, a global that holds a member however it was computed, and a
string literal equal to a reason's value where a reason is built (``reason="..."``).
Names are looked up in the imported module's globals, step by step through modules and
classes; a name bound in the enclosing function (a parameter, a local) is not a global.

Such an expression may only be compared (``==``, ``is``, ``in``, ...), and only in the
modules of ``READERS``, which read the reason they were handed. Anywhere else, or used
any other way (assigned, passed, returned, a constant), it chooses a reason: a new
refusal is a row of the decision table (or of the table after the forward), never a
``Reason`` picked by the module that found the fact out.
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from fencegate_client.reasons import Reason

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"
CHOOSERS = GATEWAY / "fencing"

# Each entry: a module outside fencing/ that compares a reason it was handed, and why.
# It still chooses none: any other use of a reason there is reported like anywhere else.
READERS: dict[str, str] = {
    "proxy/answers.py": "renders answers: the headers and the connection a reason asks for",
    "records/dashboard_queries.py": "groups audit rows by reason to show them; chooses nothing",
    "service/demo.py": "a worker's script that checks the answers it was given",
}


REASON_VALUES = frozenset(member.value for member in Reason)


class Found(NamedTuple):
    module: str  # relative to gateway/
    line: int
    name: str  # the expression as written
    use: str  # "compared", "chosen"

    def __str__(self) -> str:
        return f"gateway/{self.module}:{self.line}: {self.name} ({self.use})"


class _AnyMember:
    """A member not known until run time: ``Reason(x)``, ``Reason[x]``."""


ANY_MEMBER = _AnyMember()
UNKNOWN = object()


def _is_member(value: object) -> bool:
    return isinstance(value, Reason) or value is ANY_MEMBER


COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _targets(node: ast.AST) -> set[str]:
    """Names bound directly in the scope ``node`` opens (not in scopes nested in it)."""
    bound: set[str] = set()
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        a = node.args
        bound.update(arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs))
        bound.update(arg.arg for arg in (a.vararg, a.kwarg) if arg is not None)
    if isinstance(node, COMPREHENSIONS):
        pending: list[ast.AST] = [g.target for g in node.generators]
    elif isinstance(node, ast.Lambda):
        pending = []
    else:
        pending = list(getattr(node, "body", []))
    declared_global: set[str] = set()
    while pending:
        child = pending.pop()
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store | ast.Del):
            bound.add(child.id)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(child.name)  # its body is a scope of its own
        elif isinstance(child, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in child.names)
        elif isinstance(child, ast.ExceptHandler) and child.name:
            bound.add(child.name)
            pending.extend(ast.iter_child_nodes(child))
        elif isinstance(child, ast.Global):
            declared_global.update(child.names)
        elif not isinstance(child, (ast.Lambda, *COMPREHENSIONS)):  # scopes of their own
            pending.extend(ast.iter_child_nodes(child))
    return bound - declared_global


class _Checker:
    """One module's expressions that evaluate to a ``Reason`` member."""

    def __init__(self, module: str, tree: ast.Module, namespace: dict[str, Any]) -> None:
        self.module = module
        self.namespace = namespace
        self.parents: dict[ast.AST, ast.AST] = {
            child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)
        }
        self.found: list[Found] = []
        self._visit(tree, frozenset())
        self._globals(tree)

    def resolve(self, node: ast.AST, local: frozenset[str]) -> object:
        """The value ``node`` has at run time, where it is a module's global, an
        attribute of a module or class reached from one, or a member made by ``Reason``;
        else ``UNKNOWN``."""
        if isinstance(node, ast.Name | ast.Attribute) and not isinstance(node.ctx, ast.Load):
            return UNKNOWN  # bound here, not read
        if isinstance(node, ast.Name):
            if node.id in local:
                return UNKNOWN
            if node.id in self.namespace:
                return self.namespace[node.id]
            return getattr(builtins, node.id, UNKNOWN)
        if isinstance(node, ast.Attribute):
            owner = self.resolve(node.value, local)
            if isinstance(owner, ModuleType | type):
                try:
                    return getattr(owner, node.attr)
                except AttributeError:
                    return UNKNOWN
            return UNKNOWN
        if isinstance(node, ast.Subscript) and self.resolve(node.value, local) is Reason:
            key = node.slice
            if isinstance(key, ast.Constant) and key.value in Reason.__members__:
                return Reason[key.value]
            return ANY_MEMBER
        if isinstance(node, ast.Call):
            called = self.resolve(node.func, local)
            if called is Reason:
                return ANY_MEMBER
            if called is getattr and node.args and self.resolve(node.args[0], local) is Reason:
                return ANY_MEMBER
        return UNKNOWN

    def _visit(self, node: ast.AST, local: frozenset[str]) -> None:
        if isinstance(node, ast.expr) and _is_member(self.resolve(node, local)):
            self._add(node, ast.unparse(node))
            return  # its parts are the way to it (``fence.Reason``), not reasons
        if isinstance(node, ast.Constant) and node.value in REASON_VALUES:
            if self._builds_a_reason(node):
                self._add(node, repr(node.value))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            outer: list[ast.AST] = [*a.defaults, *(d for d in a.kw_defaults if d)]
            if not isinstance(node, ast.Lambda):
                every = (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                outer += [arg.annotation for arg in every if arg and arg.annotation]
                outer += [*node.decorator_list, *([node.returns] if node.returns else [])]
            for child in outer:
                self._visit(child, local)
            inner = local | _targets(node)
            body = [node.body] if isinstance(node, ast.Lambda) else node.body
            for child in body:
                self._visit(child, inner)
            return
        if isinstance(node, ast.ClassDef):  # its names are not its methods' locals
            inner = local | _targets(node)
            for child in ast.iter_child_nodes(node):
                method = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                self._visit(child, local if method or child not in node.body else inner)
            return
        if isinstance(node, COMPREHENSIONS):
            local = local | _targets(node)
        for child in ast.iter_child_nodes(node):
            self._visit(child, local)

    def _builds_a_reason(self, node: ast.Constant) -> bool:
        """A reason's value spelled where a reason is given: ``reason="..."`` (a keyword,
        an assignment, a dict's member, a parameter's default)."""
        parent = self.parents.get(node)
        if isinstance(parent, ast.keyword):
            return parent.arg == "reason"
        if isinstance(parent, ast.Dict):
            keys = [k for k, v in zip(parent.keys, parent.values, strict=True) if v is node]
            return any(isinstance(k, ast.Constant) and k.value == "reason" for k in keys)
        if isinstance(parent, ast.arguments):  # def f(reason="..."), the default
            positional = [*parent.posonlyargs, *parent.args]
            with_default = positional[len(positional) - len(parent.defaults) :]
            given = zip(with_default, parent.defaults, strict=True)
            kw = zip(parent.kwonlyargs, parent.kw_defaults, strict=True)
            return any(arg.arg == "reason" and d is node for arg, d in (*given, *kw))
        if isinstance(parent, ast.Assign | ast.AnnAssign) and parent.value is node:
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            return any(
                (isinstance(t, ast.Name) and t.id == "reason")
                or (isinstance(t, ast.Attribute) and t.attr == "reason")
                for t in targets
            )
        return False

    def _add(self, node: ast.expr, name: str) -> None:
        self.found.append(Found(self.module, node.lineno, name, self._use(node)))

    def _use(self, node: ast.AST) -> str:
        """``compared``: the reason is only tested against (through ``.value`` and the
        literal collection it is a member of); ``chosen``: it goes on as a value."""
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.attr == "value":
            node, parent = parent, self.parents.get(parent)
        if isinstance(parent, ast.Set | ast.Tuple | ast.List):
            node, parent = parent, self.parents.get(parent)
        return "compared" if isinstance(parent, ast.Compare) else "chosen"

    def _globals(self, tree: ast.Module) -> None:
        """A global holding a member that no expression above accounts for: imported
        (``from answers import AUTO_RESOLVED``) or computed at import."""
        seen = {f.line for f in self.found}
        bound_at: dict[str, int] = {}
        for statement in tree.body:
            if isinstance(statement, ast.Import | ast.ImportFrom):
                for alias in statement.names:
                    bound_at[alias.asname or alias.name] = statement.lineno
            elif isinstance(statement, ast.Assign | ast.AnnAssign):
                targets = (
                    statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                )
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            bound_at[name.id] = statement.lineno
        for name, value in self.namespace.items():
            if isinstance(value, Reason) and bound_at.get(name, 0) not in seen:
                self.found.append(Found(self.module, bound_at.get(name, 0), name, "chosen"))


def reasons_in(module: str, source: str, namespace: dict[str, Any]) -> list[Found]:
    """Every expression of ``source`` (the module ``module`` whose globals, once imported,
    are ``namespace``) that evaluates to a ``Reason`` member, by line."""
    found = _Checker(module, ast.parse(source), namespace).found
    return sorted(found, key=lambda f: (f.line, f.name))


def offences(found: list[Found]) -> list[Found]:
    """What may not be: a reason chosen, or one compared outside the ``READERS``."""
    return [f for f in found if f.use == "chosen" or f.module not in READERS]


def gateway_modules() -> dict[str, ModuleType]:
    """Every module under gateway/ outside fencing/, imported: ``path → module``."""
    modules = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        if path.is_relative_to(CHOOSERS):
            continue
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[str(path.relative_to(GATEWAY))] = importlib.import_module(dotted)
    return modules


def found_in_gateway() -> list[Found]:
    return [
        f
        for name, module in gateway_modules().items()
        for f in reasons_in(name, (GATEWAY / name).read_text("utf-8"), vars(module))
    ]


def test_a_reason_is_chosen_only_in_fencing() -> None:
    modules = gateway_modules()
    assert len(modules) > 30
    chosen_elsewhere = [str(f) for f in offences(found_in_gateway())]
    assert chosen_elsewhere == [], "\n".join(chosen_elsewhere)


def test_the_readers_are_few_and_each_compares_a_reason() -> None:
    assert len(READERS) <= 3
    found = found_in_gateway()
    for name, why in READERS.items():
        assert why, name
        assert (GATEWAY / name).is_file(), name
        assert any(f.module == name and f.use == "compared" for f in found), name


ALIASES = """
from fencegate_client.reasons import Reason as R
from gateway.fencing import fence
from gateway.fencing.fence import UNKNOWN_TOKEN as unknown
import fencegate_client.reasons as reasons

S = R
LATE = S.STALE_GENERATION
PICKED = pick()

class Table:
    FULL = fence.Reason.OVERLOADED

def handle(facts, verdict):
    facts.lease = fence.UNKNOWN_TOKEN
    facts.lease = unknown
    facts.lease = consts.CHOSEN
    answer(reason=LATE.value)
    answer(reason="lease-ended")
    problem = {"reason": "body-timeout", "title": "lease-ended"}
    answer(R["BODY_TOO_LARGE"], reasons.Reason(facts.name), getattr(S, facts.name))
    if verdict.reason is R.IDEMPOTENT_REPLAY or verdict.reason in (S.LEASE_EXPIRED,):
        return Table.FULL

def shadowed(fence, reason="stale-generation"):
    # A parameter: fence.UNKNOWN_TOKEN is the argument's attribute here.
    return fence.UNKNOWN_TOKEN, R.value_of_nothing
"""


def test_the_check_resolves_aliases_and_constants() -> None:
    """The guard sees a reason through aliases of ``Reason``, constants of other modules
    and of its own, names imported ``from`` a module, class attributes, a global computed
    at import, ``Reason(...)``, ``Reason[...]``, ``getattr`` and a value spelled where a
    reason is given; a comparison is told apart, a local is not taken for a global."""
    consts = ModuleType("consts")
    consts.CHOSEN = Reason.ORDERING_TIMEOUT  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {"consts": consts, "pick": lambda: Reason.UPSTREAM_TIMEOUT}
    exec(compile(ALIASES, "<aliases>", "exec"), namespace)
    found = reasons_in("proxy/fixture.py", ALIASES, namespace)
    assert [(f.line, f.name, f.use) for f in found] == [
        (4, "unknown", "chosen"),
        (8, "S.STALE_GENERATION", "chosen"),
        (9, "PICKED", "chosen"),
        (12, "fence.Reason.OVERLOADED", "chosen"),
        (15, "fence.UNKNOWN_TOKEN", "chosen"),
        (16, "unknown", "chosen"),
        (17, "consts.CHOSEN", "chosen"),
        (18, "LATE", "chosen"),
        (19, "'lease-ended'", "chosen"),
        (20, "'body-timeout'", "chosen"),
        (21, "R['BODY_TOO_LARGE']", "chosen"),
        (21, "getattr(S, facts.name)", "chosen"),
        (21, "reasons.Reason(facts.name)", "chosen"),
        (22, "R.IDEMPOTENT_REPLAY", "compared"),
        (22, "S.LEASE_EXPIRED", "compared"),
        (23, "Table.FULL", "chosen"),
        (25, "'stale-generation'", "chosen"),
    ]
    assert offences(found) == found  # not a reader: a comparison is reported too
    reader = reasons_in("proxy/answers.py", ALIASES, namespace)
    assert {f.name for f in offences(reader)} == {f.name for f in found} - {
        "R.IDEMPOTENT_REPLAY",
        "S.LEASE_EXPIRED",
    }
