"""What a request's line and headers said: ``Incoming``, read once by the intake and
never changed after. What the gateway finds out and holds for the request since is its
state machine's (``gateway.fencing.machine.RequestMachine``); the answers read both.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.config import UpstreamSettings
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
