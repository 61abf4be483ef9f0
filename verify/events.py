"""The two files of a verification run, ``history.jsonl`` and ``ledger.jsonl``: records,
readers, writer.

Both are JSON lines, one compact object a line, fields in the order below; readers ignore
fields they do not know (so a writer may add some) and blank lines. Both files' ``time``
is seconds on one clock (``time.time()`` of the machine that runs the verification), so
the times of the two files compare.

``history.jsonl``: one line per client event (``HistoryEvent``), Jepsen's model:

- ``type``: ``invoke`` when a process starts an operation; then one completion, ``ok``,
  ``fail`` (a definite refusal) or ``info`` (the outcome is unknown to the client: timeout,
  cut connection). A process has at most one operation outstanding; an invoke and its
  completion are paired by process order and share ``process``, ``f``, ``job`` and, for a
  write, ``key``. A claim from a queue may invoke with ``job`` ``""`` (not known yet); its
  completion names the job granted. An invoke with no completion (the run ended) counts as
  ``info``.
- ``f``: ``claim`` (a queue claim or a named acquire), ``renew``, ``write`` (a fenced
  request through the gateway), ``complete``, ``fail`` (the lease given back by its
  holder, the job pending again: a parked job).
- ``generation``: on a ``claim`` ``ok``, the generation granted (required); on ``renew``,
  ``complete``, ``fail`` and ``write`` events, the generation of the lease used, where known. A
  claim that got nothing (``204``) is a ``fail`` with that status.
- ``key``: the idempotency key of a ``write`` (required on every write event), else null.
  Keys are per job: a step's identity is ``(job, key)``. Spell it as the upstream receives
  it (a bare token, not a quoted structured-field string) so history and ledger match.
- ``status``: the HTTP status answered (null on ``invoke`` and ``info``). A write ``ok``
  is a 2xx, forwarded or replayed; a write ``fail`` a non-2xx answer (the gateway's refusal,
  the upstream's 4xx/5xx), with ``reason`` the problem document's ``reason`` (or null).
- ``body_sha256`` (writes): on ``invoke`` the sha256 hex of the request body sent (required);
  on ``ok`` (required) and ``fail`` the sha256 hex of the answer body received; null on
  ``info``.
- ``ttl`` (optional, after the others): on a ``claim`` or ``renew`` ``ok``, the lease's
  TTL in seconds as granted, so that a checker can tell when the lease expired.
- ``holder`` (optional): who holds the lease of a source whose generations can be
  handed out twice (a Redis lock whose fence counter was lost): the lock value's random
  part. On the ``claim`` ``ok`` that granted it and on the events of its ``renew``,
  ``write`` and ``complete``; a lease is then ``(job, generation, holder)``.
- ``replayed`` (optional, after ``holder``): on a write ``ok``, whether the answer was
  the gateway's stored one (``Idempotent-Replayed: true``) rather than the upstream's own
  answer to this request.

``ledger.jsonl``: one line per write the upstream applied, in the order applied
(``LedgerEntry``): ``time``, ``job`` and ``generation`` (the ``Fencing-Job`` and
``Fencing-Generation`` headers the gateway forwards), ``key`` (``Idempotency-Key``),
``body_sha256`` (the request body). Optional ``answer_sha256``: the sha256 hex of the
answer body the upstream gave; it differs per application (it carries the upstream's
sequence number), so two applications give two answers. Other fields (``status``,
``seq``, ...) are kept in ``extra`` and written back unchanged.

``read_history``/``read_ledger`` raise ``UnreadableFile(path, line, why)`` on a missing
file, a line that is not a JSON object, a missing field, a wrong type or value, or (history)
a completion that does not pair with its process's invoke. ``JsonlWriter`` writes them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, TypeVar, get_args

Type = Literal["invoke", "ok", "fail", "info"]
F = Literal["claim", "renew", "write", "complete", "fail"]

TYPES: Final[frozenset[str]] = frozenset(get_args(Type))
FS: Final[frozenset[str]] = frozenset(get_args(F))

HISTORY_FIELDS: Final = (
    "time",
    "process",
    "type",
    "f",
    "job",
    "generation",
    "key",
    "status",
    "reason",
    "body_sha256",
)
LEDGER_FIELDS: Final = ("time", "job", "generation", "key", "body_sha256")

_SHA256 = re.compile(r"[0-9a-f]{64}")


def sha256_hex(data: bytes) -> str:
    """The ``body_sha256`` of a body: lowercase sha256 hex."""
    return hashlib.sha256(data).hexdigest()


class UnreadableFile(Exception):
    """A history or ledger file that cannot be checked (``python -m verify check`` exits 2)."""

    def __init__(self, path: str | Path, line: int | None, why: str) -> None:
        self.path = str(path)
        self.line = line
        self.why = why
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {why}")


def _time(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"time: a number of seconds, not {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"time: not finite: {value!r}")
    return float(value)


def _str(name: str, value: object, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name}: a string{' or null' if nullable else ''}, not {value!r}")


def _int(name: str, value: object, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: an integer{' or null' if nullable else ''}, not {value!r}")


def _sha(name: str, value: object, *, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ValueError(f"{name}: 64 lowercase hex digits (sha256), not {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class HistoryEvent:
    """One line of ``history.jsonl``; the constructor checks the conventions above."""

    time: float
    process: str
    type: Type
    f: F
    job: str
    generation: int | None = None
    key: str | None = None
    status: int | None = None
    reason: str | None = None
    body_sha256: str | None = None
    ttl: float | None = None
    """``claim``/``renew`` ``ok``: the lease's TTL in seconds, as granted (optional: older
    files have none, and an expiry cannot be judged without it)."""
    holder: str | None = None
    """The holder of a lease source's lease (a Redis lock value's random part): one
    generation of a lock can be handed to two holders when the source loses its counter."""
    replayed: bool | None = None
    """A write ``ok``: whether the answer came with ``Idempotent-Replayed: true`` (from
    the gateway's store) or was the upstream's own answer to this request (optional:
    older files have none)."""
    line: int | None = field(default=None, compare=False, repr=False)
    """Line number in the file it was read from (not written)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", _time(self.time))
        _str("process", self.process)
        if self.replayed is not None and (
            not isinstance(self.replayed, bool) or self.f != "write" or self.type != "ok"
        ):
            raise ValueError("replayed: true or false, on a write ok only")
        _str("holder", self.holder, nullable=True)
        if self.holder == "":
            raise ValueError("holder: not empty (null when there is none)")
        if self.type not in TYPES:
            raise ValueError(f"type: one of {sorted(TYPES)}, not {self.type!r}")
        if self.f not in FS:
            raise ValueError(f"f: one of {sorted(FS)}, not {self.f!r}")
        _str("job", self.job)
        _int("generation", self.generation, nullable=True)
        _str("key", self.key, nullable=True)
        _int("status", self.status, nullable=True)
        _str("reason", self.reason, nullable=True)
        _sha("body_sha256", self.body_sha256, nullable=True)
        if self.ttl is not None:
            object.__setattr__(self, "ttl", _time(self.ttl))
            if self.ttl <= 0 or self.f not in ("claim", "renew") or self.type != "ok":
                raise ValueError("ttl: a positive number, on a claim or renew ok only")
        if self.f == "claim" and self.type == "ok" and self.generation is None:
            raise ValueError("a claim ok carries the generation granted")
        if not self.job and (self.f != "claim" or self.type == "ok"):
            raise ValueError("job: empty (only a claim not granted may leave it empty)")
        if self.f == "write":
            self._check_write()

    def _check_write(self) -> None:
        if self.key is None:
            raise ValueError("key: every write event carries its idempotency key")
        ok_status = self.status is not None and 200 <= self.status <= 299
        if self.type in ("invoke", "ok") and self.body_sha256 is None:
            raise ValueError(f"body_sha256: required on a write {self.type}")
        if self.type == "ok" and not ok_status:
            raise ValueError(f"status: a write ok is a 2xx answer, not {self.status!r}")
        if self.type == "fail" and (self.status is None or ok_status):
            raise ValueError(f"status: a write fail is a non-2xx answer, not {self.status!r}")
        if self.type == "info" and self.body_sha256 is not None:
            raise ValueError("body_sha256: null on info (no answer was received)")

    @property
    def acknowledged(self) -> bool:
        """A write the client got a 2xx for."""
        return self.f == "write" and self.type == "ok"

    def to_json(self) -> dict[str, Any]:
        """The line's object, fields in the file's order (then ``ttl`` and ``holder``, where
        it has them)."""
        obj = {name: getattr(self, name) for name in HISTORY_FIELDS}
        if self.ttl is not None:
            obj["ttl"] = self.ttl
        if self.holder is not None:
            obj["holder"] = self.holder
        if self.replayed is not None:
            obj["replayed"] = self.replayed
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], line: int | None = None) -> HistoryEvent:
        """Read one line's object (``ValueError`` on a missing field or a bad value)."""
        missing = [name for name in HISTORY_FIELDS if name not in obj]
        if missing:
            raise ValueError(f"missing field(s): {', '.join(missing)}")
        return cls(
            **{name: obj[name] for name in HISTORY_FIELDS},
            ttl=obj.get("ttl"),
            holder=obj.get("holder"),
            replayed=obj.get("replayed"),
            line=line,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerEntry:
    """One line of ``ledger.jsonl``: a write the upstream applied."""

    time: float
    job: str
    generation: int
    key: str
    body_sha256: str
    answer_sha256: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Fields of the line this module does not know, written back unchanged."""
    line: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", _time(self.time))
        _str("job", self.job)
        if not self.job:
            raise ValueError("job: empty")
        _int("generation", self.generation)
        _str("key", self.key)
        _sha("body_sha256", self.body_sha256)
        _sha("answer_sha256", self.answer_sha256, nullable=True)
        clash = set(self.extra) & {*LEDGER_FIELDS, "answer_sha256"}
        if clash:
            raise ValueError(f"extra: repeats field(s) {sorted(clash)}")

    def to_json(self) -> dict[str, Any]:
        """The line's object: the fields in order, then ``answer_sha256``, then extras."""
        obj: dict[str, Any] = {name: getattr(self, name) for name in LEDGER_FIELDS}
        if self.answer_sha256 is not None:
            obj["answer_sha256"] = self.answer_sha256
        obj.update(self.extra)
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], line: int | None = None) -> LedgerEntry:
        """Read one line's object (``ValueError`` on a missing field or a bad value)."""
        missing = [name for name in LEDGER_FIELDS if name not in obj]
        if missing:
            raise ValueError(f"missing field(s): {', '.join(missing)}")
        known = {*LEDGER_FIELDS, "answer_sha256"}
        return cls(
            **{name: obj[name] for name in LEDGER_FIELDS},
            answer_sha256=obj.get("answer_sha256"),
            extra={k: v for k, v in obj.items() if k not in known},
            line=line,
        )


HELD_FIELDS: Final = ("time", "job", "key", "generation")


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldUnknown:
    """One line of ``unknowns.jsonl`` (optional, invariant 13): a key the gateway held as
    an unknown outcome when it was listed at ``time`` (``GET /admin/unknown-outcomes``, an
    item whose ``state`` is ``unknown``), under ``generation``: the generation whose write
    the record is. Other fields (``note``, ``updated_at``, ...) are kept in ``extra``."""

    time: float
    job: str
    key: str
    generation: int
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    line: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", _time(self.time))
        _str("job", self.job)
        if not self.job:
            raise ValueError("job: empty")
        _str("key", self.key)
        _int("generation", self.generation)
        clash = set(self.extra) & set(HELD_FIELDS)
        if clash:
            raise ValueError(f"extra: repeats field(s) {sorted(clash)}")

    def to_json(self) -> dict[str, Any]:
        return {**{name: getattr(self, name) for name in HELD_FIELDS}, **self.extra}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], line: int | None = None) -> HeldUnknown:
        missing = [name for name in HELD_FIELDS if name not in obj]
        if missing:
            raise ValueError(f"missing field(s): {', '.join(missing)}")
        return cls(
            **{name: obj[name] for name in HELD_FIELDS},
            extra={k: v for k, v in obj.items() if k not in HELD_FIELDS},
            line=line,
        )


Record = HistoryEvent | LedgerEntry | HeldUnknown
_R = TypeVar("_R", HistoryEvent, LedgerEntry, HeldUnknown)


def _read(path: str | Path, parse: Callable[[Mapping[str, Any], int], _R]) -> list[_R]:
    try:
        with open(path, "rb") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise UnreadableFile(path, None, exc.strerror or str(exc)) from exc
    records: list[_R] = []
    for number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UnreadableFile(path, number, f"not UTF-8: {exc}") from exc
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise UnreadableFile(path, number, f"not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise UnreadableFile(path, number, "not a JSON object")
        try:
            records.append(parse(obj, number))
        except (ValueError, TypeError) as exc:
            raise UnreadableFile(path, number, str(exc)) from exc
    return records


def read_history(path: str | Path) -> list[HistoryEvent]:
    """All events of a ``history.jsonl``, checked line by line and paired by process."""
    events = _read(path, HistoryEvent.from_json)
    try:
        check_pairing(events)
    except PairingError as exc:
        raise UnreadableFile(path, exc.event.line, str(exc)) from exc
    return events


def read_ledger(path: str | Path) -> list[LedgerEntry]:
    """All entries of a ``ledger.jsonl``, in the order applied."""
    return _read(path, LedgerEntry.from_json)


def read_unknowns(path: str | Path) -> list[HeldUnknown]:
    """All lines of an ``unknowns.jsonl``: the keys the gateway was seen holding unknown."""
    return _read(path, HeldUnknown.from_json)


class PairingError(ValueError):
    """A completion that does not answer its process's outstanding invoke."""

    def __init__(self, event: HistoryEvent, why: str) -> None:
        self.event = event
        super().__init__(why)


def check_pairing(events: list[HistoryEvent]) -> None:
    """Each completion answers its process's one outstanding invoke (``PairingError``)."""
    outstanding: dict[str, HistoryEvent] = {}
    for event in events:
        invoke = outstanding.get(event.process)
        if event.type == "invoke":
            if invoke is not None:
                raise PairingError(
                    event,
                    f"process {event.process!r} invokes while its {invoke.f} invoked "
                    f"at line {invoke.line} is outstanding",
                )
            outstanding[event.process] = event
            continue
        if invoke is None:
            raise PairingError(
                event, f"{event.type} of process {event.process!r} with no invoke outstanding"
            )
        del outstanding[event.process]
        same_job = invoke.job == event.job or (invoke.f == "claim" and not invoke.job)
        if invoke.f != event.f or not same_job or invoke.key != event.key:
            raise PairingError(
                event,
                f"{event.type} ({event.f}, job {event.job!r}, key {event.key!r}) does not "
                f"match the invoke at line {invoke.line} ({invoke.f}, job {invoke.job!r}, "
                f"key {invoke.key!r})",
            )


class JsonlWriter:
    """Appends records to a JSON lines file: one compact line each, flushed at once.

    Safe to share between threads. Use as a context manager or call ``close()``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: Record | Mapping[str, Any]) -> None:
        obj = record if isinstance(record, Mapping) else record.to_json()
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        with self._lock:
            self._file.write(text + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
