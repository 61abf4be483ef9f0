"""One request's state, by stage.

``Incoming`` is what the request's line and headers said, read once by the intake and
never changed after. ``Progress`` is what the gateway has found out and holds for the
request since: its slot, its body, the admission's answer, the key's record or its
``Claim`` on the key, and the headers a forwarded write went with. Each step of
``handler.Gateway`` reads the first and fills in the second; the answers read both.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDict

from gateway.config import UpstreamSettings
from gateway.fencing.fence import Admission, Record
from gateway.sources import Source


@dataclass(frozen=True, slots=True)
class Incoming:
    """What the request's line and headers say (``intake``); a field the intake did not
    reach (it stopped at a refusal) keeps its default."""

    request: web.Request
    upstream: UpstreamSettings | None = None
    rest: str = ""  # the path after the upstream's name
    query: str = ""
    method: str = ""  # the method as the fingerprint names it (with an override, if any)
    key: str | None = None  # the idempotency key (a generated anonymous one if none)
    token_hash: str | None = None  # the gateway's own ``fgl_`` token, hashed
    # The token's lease source (``gateway.sources``) and its own token; None for the
    # gateway's own tokens. ``source_name``: the metrics' label for either.
    source: Source | None = None
    source_token: str | None = None
    source_name: str | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """The key is this request's: claimed, or taken over, under ``attempt``."""

    attempt: str
    back_to: Record | None  # the record before we took it over
    send_by: float  # time.monotonic() after which the write stays unsent


@dataclass(slots=True)
class Progress:
    """What the gateway found out and holds for one request so far."""

    started: float = field(default_factory=time.perf_counter)
    slot: str | None = None  # the pool whose slot this request holds
    body: io.BytesIO | None = None  # the request body, read once (the only copy)
    fingerprint: str | None = None
    admission: Admission | None = None  # the latest look at the lease (and the key)
    record: Record | None = None  # the key's record, when it answers for the request
    claim: Claim | None = None
    send_left: float | None = None  # seconds the claim still allows, judged at the send
    forwarded: CIMultiDict[str] | None = None  # the headers a fenced write went with
