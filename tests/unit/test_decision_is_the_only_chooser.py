"""A ``Reason`` is chosen in the decision modules and nowhere else in the gateway.

Every module under ``gateway/`` is parsed; naming a member of the ``Reason`` enum
(``Reason.X``, ``fence.Reason.X``, ``R.X`` after ``import Reason as R``) outside the
allow-list below fails. A new refusal is a row of the decision table (or of the table
after the forward), never a ``Reason`` picked by the module that found the fact out.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fencegate_client.reasons import Reason

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"

# Each entry: why this module may name a reason.
ALLOWED: dict[str, str] = {
    "fencing/decision.py": "the decision table, and the answers outside its walk",
    "fencing/fence.py": "the rules behind the table's facts (lease, record, source, send)",
    "fencing/after_forward.py": "the small table of the answers after the forward",
    "fencing/resolution.py": "the resolver's rules: not re-sent, and what a re-send's answer makes",
    "proxy/answers.py": "renders answers: the members and the connection a reason asks for",
    "records/dashboard_queries.py": "groups audit rows by reason to show them; chooses nothing",
    "service/demo.py": "a worker's script that checks the answers it was given",
}

MEMBERS = frozenset(Reason.__members__)


def reason_namings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of each attribute access to a ``Reason`` member, however imported."""
    aliases = {"Reason"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            aliases.update(a.asname or a.name for a in node.names if a.name == "Reason")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if node.value.id in aliases:  # ``R = Reason``
                aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in MEMBERS:
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id in aliases) or (
            isinstance(owner, ast.Attribute) and owner.attr == "Reason"
        ):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_a_reason_is_chosen_only_in_the_decision_modules() -> None:
    modules = sorted(GATEWAY.rglob("*.py"))
    assert len(modules) > 30
    chosen_elsewhere = [
        f"gateway/{path.relative_to(GATEWAY)}:{line}: {text}"
        for path in modules
        if str(path.relative_to(GATEWAY)) not in ALLOWED
        for line, text in reason_namings(ast.parse(path.read_text("utf-8")))
    ]
    assert chosen_elsewhere == [], "\n".join(chosen_elsewhere)


def test_the_allow_list_is_short_and_each_entry_is_used() -> None:
    assert len(ALLOWED) <= 7
    for name, why in ALLOWED.items():
        assert why, name
        path = GATEWAY / name
        assert path.is_file(), name
        assert reason_namings(ast.parse(path.read_text("utf-8"))), f"{name} names no reason"


def test_the_check_sees_every_spelling() -> None:
    source = """
from fencegate_client.reasons import Reason as R
from . import fence
import fencegate_client.reasons as reasons
a = R.STALE_GENERATION
b = fence.Reason.LEASE_ENDED.value
c = reasons.Reason.BODY_TOO_LARGE
S = R
d = S.OVERLOADED
e = R.value_of_nothing
"""
    assert [text for _, text in reason_namings(ast.parse(source))] == [
        "R.STALE_GENERATION",
        "fence.Reason.LEASE_ENDED",
        "reasons.Reason.BODY_TOO_LARGE",
        "S.OVERLOADED",
    ]
