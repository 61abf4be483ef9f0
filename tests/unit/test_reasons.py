"""``fencegate_client.reasons``: every problem reason spelled once, with its facts.

The values are the wire format, so this file spells them out literally: a renamed member
must not change what workers and operators see. Beyond that, the catalogue agrees with
the exception classes of the lease API and with the gateway's table, and no other module
of the three packages spells a reason's value.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

from fencegate_client import errors, reasons
from fencegate_client.reasons import AUDIT_ONLY, GATEWAY_REASONS, REASONS, Layer, Reason, Sent
from gateway.fencing import fence
from lease_core import exceptions as lease_exc
from tests import lease_model as rules

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lease_core", "gateway", "client/fencegate_client")  # folders under ROOT
HOME = ROOT / "client" / "fencegate_client" / "reasons.py"

# Every reason on the wire, with its status (None: not fixed) and who answers it.
WIRE: dict[str, tuple[int | None, str]] = {
    # SPEC.md, "Gateway protocol" (and docs/protocol.md, "Reasons on the proxy listener")
    "unknown-upstream": (404, "gateway"),
    "missing-fencing-token": (428, "gateway"),
    "invalid-fencing-token": (403, "gateway"),
    "missing-idempotency-key": (400, "gateway"),
    "stale-generation": (409, "both"),
    "lease-ended": (409, "both"),
    "lease-expired": (409, "both"),
    "generation-reissued": (409, "gateway"),
    "body-too-large": (413, "gateway"),
    "idempotency-key-reused": (422, "gateway"),
    "request-in-progress": (409, "gateway"),
    "outcome-unknown": (409, "gateway"),
    "ordering-timeout": (503, "gateway"),
    "upstream-unavailable": (502, "gateway"),
    "upstream-timeout": (504, "gateway"),
    "upstream-connection-lost": (502, "gateway"),
    "precondition-failed": (412, "gateway"),
    "idempotent-replay": (None, "gateway"),  # audited with the stored status
    "auto-resolved": (None, "gateway"),  # audited with the status of the answer it stored
    # the gateway's beyond the spec's table
    "invalid-request": (400, "both"),
    "body-timeout": (408, "gateway"),
    "store-unavailable": (503, "both"),
    "gateway-overloaded": (503, "gateway"),
    "replay-unavailable": (409, "gateway"),
    # the control listener's (SPEC.md: 401, 403, 404, 409 job-exists; docs/protocol.md)
    "internal-error": (500, "both"),
    "unauthorized": (401, "lease-api"),
    "forbidden": (403, "lease-api"),
    "invalid-lease-token": (403, "lease-api"),
    "job-not-found": (404, "lease-api"),
    "not-found": (404, "lease-api"),
    "method-not-allowed": (405, "lease-api"),
    "job-exists": (409, "lease-api"),
    "lease-held": (409, "lease-api"),
    "job-finished": (409, "lease-api"),
    "http-error": (None, "lease-api"),  # aiohttp's own status and reason phrase
    # the worker client's own, for a RemoteError
    "invalid-response": (None, "client"),
}

LAYERS = {
    "gateway": Layer.GATEWAY,
    "lease-api": Layer.LEASE_API,
    "both": Layer.GATEWAY | Layer.LEASE_API,
}


def test_values_are_unique_and_none_is_an_alias() -> None:
    values = [member.value for member in Reason.__members__.values()]
    assert len(values) == len(set(values)), "two members share a value (an enum alias)"
    assert len(Reason.__members__) == len(list(Reason))


@pytest.mark.parametrize("reason", list(Reason))
def test_a_value_is_a_lowercase_identifier(reason: Reason) -> None:
    assert re.fullmatch(r"[a-z]+(-[a-z]+)*", reason.value), reason


def test_the_wire_values_are_these() -> None:
    assert {r.value for r in Reason} == set(WIRE)


@pytest.mark.parametrize(("value", "facts"), WIRE.items())
def test_status_and_layer_of_each_reason(value: str, facts: tuple[int | None, str]) -> None:
    status, who = facts
    reason = Reason(value)
    if status is None:
        assert reason not in REASONS
        return
    info = REASONS[reason]
    assert info.status == status
    assert info.layers == LAYERS[who]
    assert info.title.strip()
    # The gateway's answers carry its default detail; a lease-API error's is its docstring.
    assert bool(info.detail.strip()) == (Layer.GATEWAY in info.layers), reason
    if info.retry_after:
        assert Layer.GATEWAY in info.layers


def test_the_gateway_reasons_are_its_rows_and_the_replay() -> None:
    assert set(GATEWAY_REASONS) == {
        Reason(v) for v, (_, who) in WIRE.items() if who in ("gateway", "both")
    }
    assert list(GATEWAY_REASONS) == [r for r in Reason if r in GATEWAY_REASONS]  # enum order
    assert set(fence.PROBLEMS) == set(GATEWAY_REASONS) - AUDIT_ONLY
    assert fence.Reason is Reason
    for reason, info in fence.PROBLEMS.items():
        assert info is REASONS[reason]


# -- the lease API's exception classes ----------------------------------------------------


def exception_classes() -> list[type[errors.LeaseError]]:
    """Every class of ``errors`` that names a reason of its own (the base included)."""
    return [
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, errors.LeaseError) and "reason" in vars(obj)
    ]


def test_each_class_maps_to_a_distinct_reason() -> None:
    classes = exception_classes()
    named = [cls.reason for cls in classes]
    assert len(named) == len(set(named)), named
    assert all(isinstance(r, Reason) for r in named)


def test_each_lease_api_reason_has_one_class() -> None:
    """And the gateway's own way of losing a lease (a lease source's generation issued
    twice), which the client raises as a ``LeaseLost`` too."""
    named = {cls.reason for cls in exception_classes()}
    lease_api = {r for r, info in REASONS.items() if Layer.LEASE_API in info.layers}
    assert named == lease_api | {Reason.GENERATION_REISSUED}


@pytest.mark.parametrize("cls", exception_classes(), ids=lambda c: c.__name__)
def test_a_class_has_its_reasons_status_and_title(cls: type[errors.LeaseError]) -> None:
    info = REASONS[cls.reason]
    assert (cls.status, cls.title) == (info.status, info.title)
    error = cls()
    assert (error.status, error.reason, error.title) == (info.status, cls.reason, info.title)
    assert error.detail == (cls.__doc__ or "").strip()


@pytest.mark.parametrize("cls", exception_classes(), ids=lambda c: c.__name__)
def test_a_problem_comes_back_as_its_class(cls: type[errors.LeaseError]) -> None:
    doc = {"reason": cls.reason.value, "status": cls.status, "detail": "d", "job_id": "j"}
    error = errors.error_from_problem(cls.status, doc)
    if cls is errors.LeaseError:  # internal-error: the server's failure, kept as sent
        assert isinstance(error, errors.RemoteError)
        assert (error.remote_status, error.remote_reason) == (500, "internal-error")
        return
    assert type(error) is cls
    assert error.extra == {"job_id": "j"}


def test_the_lost_lease_reasons() -> None:
    lost = {"stale-generation", "lease-ended", "lease-expired", "generation-reissued"}
    assert set(errors.LOST_BY_REASON) == lost
    for value, cls in errors.LOST_BY_REASON.items():
        assert issubclass(cls, errors.LeaseLost) and cls.reason == value
    assert lease_exc.LOST_BY_REASON is errors.LOST_BY_REASON


def test_refusal_reason_answers_members() -> None:
    job = rules.Job("j", rules.State.LEASED, 5, "w", lease_expires_at=10.0)
    assert rules.refusal_reason(4, job, 0.0) is Reason.STALE_GENERATION
    assert rules.refusal_reason(5, job, 20.0) is Reason.LEASE_EXPIRED
    assert rules.refusal_reason(5, rules.complete(job), 0.0) is Reason.LEASE_ENDED


# -- spelled once ---------------------------------------------------------------------------


def sources() -> list[Path]:
    found = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert HOME in found
    return [p for p in found if p != HOME]


def test_no_other_module_spells_a_reason() -> None:
    """A reason's value, quoted, appears in ``fencegate_client/reasons.py`` only: compare
    with and produce ``Reason`` members everywhere else."""
    spelled: list[str] = []
    for path in sources():
        text = path.read_text(encoding="utf-8")
        for reason in Reason:
            for quote in ('"', "'"):
                if f"{quote}{reason.value}{quote}" in text:
                    spelled.append(f"{path.relative_to(ROOT)}: {quote}{reason.value}{quote}")
    assert not spelled, "use fencegate_client.reasons.Reason instead:\n" + "\n".join(spelled)


def test_the_catalogue_spells_each_reason_once() -> None:
    text = HOME.read_text(encoding="utf-8")
    for reason in Reason:
        assert text.count(f'"{reason.value}"') == 1, reason


def test_the_catalogue_needs_only_the_standard_library() -> None:
    """Workers install the client package; the catalogue is its lowest layer."""
    tree = ast.parse(HOME.read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "reasons.py imports nothing of Fencegate"
            imported.add((node.module or "").partition(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    assert reasons.__name__ == "fencegate_client.reasons"


# What each of the gateway's answers says of the write (``Sent``), written down here a
# second time on purpose: a change to one fact must be made in both places.
SENT = {
    "never": {
        "unknown-upstream",
        "invalid-request",
        "missing-fencing-token",
        "invalid-fencing-token",
        "missing-idempotency-key",
        "stale-generation",
        "lease-ended",
        "lease-expired",
        "generation-reissued",
        "body-too-large",
        "body-timeout",
        "idempotency-key-reused",
        "request-in-progress",
        "ordering-timeout",
        "upstream-unavailable",
        "gateway-overloaded",
        "store-unavailable",
    },
    "maybe": {"outcome-unknown", "upstream-timeout", "upstream-connection-lost", "internal-error"},
    "yes": {"replay-unavailable", "precondition-failed"},
}


def test_each_gateway_answer_says_whether_the_write_was_sent() -> None:
    """Every reason the gateway answers with says one thing of the write: sent never,
    maybe or yes; "never" (and only it) may be retried under a new key."""
    found: dict[str, set[str]] = {"never": set(), "maybe": set(), "yes": set()}
    for reason, info in REASONS.items():
        if Layer.GATEWAY in info.layers:
            assert info.sent is not None, reason
            found[info.sent.value].add(reason.value)
        else:
            assert info.sent is None, reason
    assert found == SENT
    assert REASONS[Reason.STORE_UNAVAILABLE].sent is Sent.NEVER
