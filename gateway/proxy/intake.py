"""Intake: what a request's line and headers say, read once and without I/O.

The target (which upstream, which path), the framing we refuse rather than guess at,
the fencing headers and the method override become ``decision.Facts`` and an
``Incoming`` (``request.py``);
``forward_headers`` is the header hygiene on the way out: which client headers reach
the upstream and which the gateway sets itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config import GatewaySettings, UpstreamSettings
from gateway.config.problems import nearest
from gateway.fencing import fence, profiles
from gateway.fencing.deadlines import DuplicateWait, Timing
from gateway.fencing.decision import Facts, NoUpstream
from gateway.fencing.fence import UnknownOutcome
from gateway.fencing.machine import RequestMachine
from gateway.observe import tracing
from gateway.observe.logs import REQUEST_ID
from gateway.proxy.duplicates import prefer_wait
from gateway.proxy.incoming import Incoming
from gateway.sources import Source, split_token
from gateway.upstream import s3
from gateway.upstream.hops import HOP_BY_HOP, connection_named
from lease_core import tokens

# Never forwarded from the client: the credential, what we set ourselves, what aiohttp sets.
DROP_FROM_CLIENT = HOP_BY_HOP | {
    "fencing-token",
    "fencing-job",
    "fencing-generation",
    "host",
    "content-length",
    "expect",
}
# Client headers that could tell the upstream another story about the request than the
# gateway checked: where it came from, which URL it was for.
DROP_FROM_CLIENT |= {"forwarded", "x-original-url", "x-rewrite-url"}
# Headers that make an upstream treat a request as another method. On a method that is
# not fenced they would turn a pass-through into an unfenced write: refused.
METHOD_OVERRIDES = frozenset({"x-http-method-override", "x-http-method", "x-method-override"})
PROTECTED = frozenset({"fencing-token", "idempotency-key"})
ENCODED_SLASH = re.compile("%2f", re.IGNORECASE)


def intake(
    request: web.Request,
    upstreams: Mapping[str, UpstreamSettings],
    max_key_length: int,
    sources: Mapping[str, Source] | None = None,
    lease_api_at: str | None = None,
) -> tuple[Incoming, Facts]:
    """What the request line and headers say, and the facts they carry (no I/O). A fact
    left at its default passes its row; the walk stops at the first refusal anyway."""
    facts = Facts()
    found = target(request)
    if isinstance(found, str):
        facts.bad_target = found
        return Incoming(request), facts
    framing = framing_problem(request)
    if framing is not None:
        facts.bad_target = framing
        return Incoming(request), facts
    name, rest, query = found
    upstream = upstreams.get(name)
    if upstream is None:
        name = name[:100]
        near = nearest(name, upstreams)
        facts.unknown_upstream = NoUpstream(name, near, lease_api_at)
        return Incoming(request, rest=rest, query=query), facts
    limit = upstream.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        facts.over_limit = True  # declared: known without reading
    override = method_override(request.headers)
    if request.method not in upstream.fenced_methods:
        facts.fenced = False
        facts.override_on_unfenced = override is not None
        return Incoming(request, upstream, rest, query), facts
    method = request.method if override is None else f"{request.method} as {override}"

    return _fencing_headers(request, upstream, rest, query, method, facts, max_key_length, sources)


def _fencing_headers(
    request: web.Request,
    upstream: UpstreamSettings,
    rest: str,
    query: str,
    method: str,
    facts: Facts,
    max_key_length: int,
    sources: Mapping[str, Source] | None,
) -> tuple[Incoming, Facts]:
    """A fenced write's own headers: its one ``Fencing-Token`` (the gateway's, or a
    lease source's) and its ``Idempotency-Key``."""
    presented = request.headers.getall("Fencing-Token", [])
    facts.token_headers = len(presented)
    if len(presented) != 1:
        return Incoming(request, upstream, rest, query, method), facts
    token = presented[0].strip()
    facts.token_as_bearer = token[:7].lower() == "bearer "
    source, source_token, token_hash = None, None, None
    named = split_token(token, sources) if sources else None
    if named is not None:  # a lease of another source
        source, source_token = named
        source_name = source.name
        facts.token_well_formed = source.well_formed(source_token)
    else:
        source_name = "fencegate"
        facts.token_well_formed = tokens.is_well_formed(token)
        if facts.token_well_formed:
            token_hash = tokens.hash_token(token)
    facts.protected_hop_by_hop = bool(connection_named(request.headers.items()) & PROTECTED)
    key_headers = request.headers.getall("Idempotency-Key", [])
    key = None
    if len(key_headers) == 1:
        key = fence.parse_key(key_headers[0], max_key_length)
    facts.key_acceptable = key is not None or not (key_headers or upstream.require_idempotency_key)
    incoming = Incoming(
        request,
        upstream,
        rest,
        query,
        method,
        key=key or fence.anonymous_key(),
        token_hash=token_hash,
        source=source,
        source_token=source_token,
        source_name=source_name,
    )
    return incoming, facts


def target(request: web.Request) -> tuple[str, str, str] | str:
    """(upstream name, rest of the path, raw query), or why the target is refused."""
    if request.method == "CONNECT":
        return "CONNECT is not supported: this is not an open proxy."
    raw = request.raw_path
    if not raw.startswith("/"):
        return "Absolute-form targets are not supported: this is not an open proxy."
    path, _, query = raw.partition("?")
    name, _, rest = path[1:].partition("/")
    name = unquote(name)
    # A generated client percent-encodes the {path} parameter whole (v1%2Fcharges): an
    # encoded slash is a slash here, as Envoy's UNESCAPE_AND_FORWARD makes it. The
    # dot-segment check below reads the decoded path, so %2F..%2F is refused as ../ is.
    rest = ENCODED_SLASH.sub("/", rest)
    decoded = unquote(rest)
    # Encoded or not, nothing may climb out of the upstream's base path.
    if any(segment in (".", "..") for segment in decoded.replace("\\", "/").split("/")):
        return "Dot-segments are not allowed in the path."
    if "\\" in decoded:
        return "Backslashes are not allowed in the path."
    return name, rest, query


def framing_problem(request: web.Request) -> str | None:
    """Body framing we refuse rather than guess at (request smuggling lives here)."""
    codings = [
        c.strip().lower()
        for v in request.headers.getall("Transfer-Encoding", [])
        for c in v.split(",")
        if c.strip()
    ]
    if not codings:
        return None
    if request.version < aiohttp.HttpVersion11:
        return "Transfer-Encoding is not allowed in HTTP/1.0."
    if codings != ["chunked"]:
        return "Only Transfer-Encoding: chunked is supported."
    return None


def method_override(headers: CIMultiDictProxy[str]) -> str | None:
    """The method a method-override header asks for (any spelling of its name), if any."""
    for name, value in headers.items():
        lower = name.lower()
        if lower.startswith("x") and lower.replace("_", "-") in METHOD_OVERRIDES:
            return value.strip().upper()[:32]
    return None


def _controlled(lower: str, upstream: UpstreamSettings) -> bool:
    """A header name (with ``-`` for ``_``) that the gateway drops or sets itself: a
    client's ``Fencing_Job`` reaches a CGI-style upstream as ``Fencing-Job`` would."""
    return (
        lower in DROP_FROM_CLIENT
        or lower in PROTECTED
        or lower == "x-request-id"
        or lower.startswith("x-forwarded-")
        or lower in upstream.set_header_names
    )


def forward_headers(
    request: web.Request,
    upstream: UpstreamSettings,
    job_id: str | None,
    generation: int | None,
    key: str | None,
) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop, the credential and what we set; plus fencing
    headers, the key in its one canonical form, forwarding headers and the upstream's own
    configured headers."""
    incoming: CIMultiDictProxy[str] = request.headers
    named = connection_named(incoming.items())
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        if lower in DROP_FROM_CLIENT or lower in named or lower.startswith("x-forwarded-"):
            continue
        if "_" in lower and _controlled(lower.replace("_", "-"), upstream):
            continue
        out.add(name, value)
    dedup_header = upstream.dedup_header
    if dedup_header is not None:
        # The upstream's key is the gateway's to set, never the worker's.
        out.popall(dedup_header, None)
        out.popall("Idempotency-Key", None)
    if job_id is not None and generation is not None:
        out["Fencing-Job"] = job_id
        out["Fencing-Generation"] = str(generation)
        if key is not None and not fence.is_anonymous(key):
            if dedup_header is None:
                out["Idempotency-Key"] = fence.canonical_key(key)
            else:
                # The upstream's own key, stable per (job, key): the same for every
                # retry of the step, whichever generation or replica sends it.
                out[dedup_header] = profiles.upstream_key(job_id, key)
    previous = incoming.get("X-Forwarded-For")
    remote = request.remote or "unknown"
    out["X-Forwarded-For"] = f"{previous}, {remote}" if previous else remote
    out["X-Forwarded-Proto"] = request.scheme
    out["X-Request-Id"] = REQUEST_ID.get()
    for name, secret in upstream.set_headers.items():
        out[name] = secret.get_secret_value()
    if tracing.ENABLED:
        tracing.forwarding(out, job_id, generation)
    return out


def outgoing_headers(
    incoming: Incoming, machine: RequestMachine, *, fenced: bool
) -> CIMultiDict[str]:
    """The headers the upstream gets: the fencing headers on a fenced write (and on
    an S3 object write, the fencing metadata only the gateway writes)."""
    upstream, request = incoming.upstream, incoming.request
    assert upstream is not None
    if not fenced:
        headers = forward_headers(request, upstream, None, None, None)
        if upstream.signing is not None:
            s3.drop_metadata(headers)
        return headers
    job_id, generation, key = machine.job_id, machine.generation, incoming.key
    headers = forward_headers(request, upstream, job_id, generation, key)
    if upstream.signing is not None:
        s3.drop_metadata(headers)  # only the gateway writes the fencing metadata
        if (
            key is not None
            and not fence.is_anonymous(key)
            and s3.is_object_write(request.method, incoming.rest, incoming.query)
        ):
            s3.stamp(headers, job_id, generation, profiles.upstream_key(job_id, key))
    return headers


def begin(
    request: web.Request,
    limits: GatewaySettings,
    upstreams: Mapping[str, UpstreamSettings],
    sources: Mapping[str, Source],
    lease_api_at: str | None = None,
    *,
    resolving: bool = False,
) -> tuple[Incoming, RequestMachine]:
    """The request's line and headers read (``intake``), and its state machine made;
    ``lease_api_at`` (control_listen) is named to a lease call sent here by mistake;
    ``resolving``: some upstream's unknown outcomes are the gateway's to re-send."""
    incoming, facts = intake(
        request, upstreams, limits.max_idempotency_key_length, sources, lease_api_at
    )
    upstream = incoming.upstream
    timing = None
    if upstream is not None:
        timing = Timing(
            limits.ordering_wait_seconds, upstream.timeout_seconds, upstream.connect_timeout_seconds
        )
    machine = RequestMachine(
        facts,
        time.perf_counter(),
        timing=timing,
        body_arrived=request.content.is_eof(),
        policy=UnknownOutcome.HOLD if upstream is None else upstream.unknown_outcome,
        wait=asked_wait(request, facts.fenced, limits.max_prefer_wait_seconds),
        resolving=resolving,
    )
    return incoming, machine


def asked_wait(request: web.Request, fenced: bool, cap: int) -> DuplicateWait | None:
    """``Prefer: wait=N`` (RFC 7240) on a fenced write: how long it may wait for its
    key's first attempt, if that is in flight (capped; a malformed one is ignored)."""
    if not fenced or cap == 0:
        return None
    asked = prefer_wait(request.headers.getall("Prefer", []))
    return DuplicateWait(min(asked, cap)) if asked else None
