"""Unknown outcomes that the gateway resolves itself (``unknown_outcome = "resolve"``).

An upstream that deduplicates by key (``[upstreams.dedup] header``) answers a re-send of
the same request under the same key with the answer of the first, or applies it once if
the first never arrived. So, inside the upstream's window, the gateway re-sends a held
write, byte for byte, under the key it sent before, and stores the answer as the key's:
the worker's retry then gets it as a replay. Each round is one record claimed by one
conditional statement (``claim_resolution``), so replicas never re-send one record
twice; while it is claimed the record is in flight, so the ordering barrier holds (a
newer generation's write waits) and a worker's retry is told ``request-in-progress``.

What goes to the operator instead, as before: a record past the window, one re-sent
``gateway.resolve_max_attempts`` times, one whose request was not kept (larger than
``gateway.max_replay_body_bytes``, or left in flight by a crashed replica), one whose job
a newer generation has written since, and one the upstream answers "key used with other
parameters" (``dedup.mismatch_status``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from .audit import Audit, AuditEntry
from .config import GatewaySettings, UpstreamSettings
from .fence import Reason, RecordState
from .forwarding import DROP_FROM_UPSTREAM, UNKNOWN_STATUSES, Forwarder, upstream_url
from .intake import connection_named
from .metrics import GatewayMetrics
from .profiles import is_mismatch
from .store import GatewayStore, KeptRequest, Resolution

log = logging.getLogger("fencegate.resolve")

# Seconds between two re-sends of one record (its claim's ``pause``).
PAUSE = 1.0
# Records one round resolves per upstream at most (the next round goes on).
ROUND = 50
MARGIN = 1.0  # as the proxy's DEADLINE_MARGIN


class Resolver:
    """Finds the unknown outcomes it may resolve, re-sends them, settles them."""

    def __init__(
        self,
        limits: GatewaySettings,
        store: GatewayStore,
        forwarder: Forwarder,
        audit: Audit,
        metrics: GatewayMetrics,
        upstreams: Callable[[], Mapping[str, UpstreamSettings]],
    ) -> None:
        self.limits = limits
        self.store = store
        self.forwarder = forwarder
        self.audit = audit
        self.metrics = metrics
        self.upstreams = upstreams

    async def run_once(self) -> int:
        """One round over every upstream with ``unknown_outcome = "resolve"``; how many
        records it settled with an answer."""
        if self.forwarder.session is None:  # the proxy listener is not up (yet)
            return 0
        settled = 0
        for upstream in list(self.upstreams().values()):
            if upstream.unknown_outcome != "resolve" or upstream.dedup is None:
                continue
            for _ in range(ROUND):
                claimed = await self.store.claim_resolution(
                    upstream.name,
                    window=upstream.dedup.window_seconds - upstream.timeout_seconds - MARGIN,
                    max_attempts=self.limits.resolve_max_attempts,
                    pause=PAUSE,
                    deadline_in=upstream.timeout_seconds
                    + upstream.connect_timeout_seconds
                    + 2 * MARGIN,
                )
                if claimed is None:
                    break
                settled += await self.resolve(upstream, claimed)
        return settled

    async def resolve(self, upstream: UpstreamSettings, claimed: Resolution) -> int:
        """Re-send one claimed record and settle it; 1 when it got its answer."""
        claim = await self.store.claim(claimed.job_id, claimed.key, claimed.attempt)
        if claim.fence is not None and claim.fence > claimed.generation:
            # A newer generation was admitted since: an older write is never sent after it.
            await self._unknown(
                upstream,
                claimed,
                "a newer generation of the job has written since: not re-sent; resolve it by hand",
                keep=False,
                outcome="superseded",
            )
            return 0
        assert self.forwarder.session is not None
        headers = _headers(claimed.request, upstream)
        timeout = aiohttp.ClientTimeout(
            total=upstream.timeout_seconds, sock_connect=upstream.connect_timeout_seconds
        )
        url = upstream_url(upstream, claimed.path, claimed.request.query)
        try:
            async with self.forwarder.session.request(
                claimed.method.split(" as ")[0],
                URL(url, encoded=True),
                headers=headers,
                data=claimed.request.body,
                allow_redirects=False,
                timeout=timeout,
            ) as response:
                status = response.status
                body = await response.read()
                named = connection_named(response.headers)
                answer_headers = [
                    (k, v)
                    for k, v in response.headers.items()
                    if k.lower() not in DROP_FROM_UPSTREAM and k.lower() not in named
                ]
        except (TimeoutError, aiohttp.ClientError) as error:
            await self._unknown(
                upstream, claimed, f"re-sent, no answer: {type(error).__name__}", keep=True
            )
            return 0
        dedup = upstream.dedup
        assert dedup is not None
        if is_mismatch(status, body, dedup.mismatch_status, dedup.mismatch_contains):
            await self._unknown(
                upstream,
                claimed,
                f"re-sent; the upstream answered {status}: this key was used with other "
                "parameters. Resolve it by hand",
                keep=False,
                status=status,
                outcome="mismatch",
            )
            return 0
        if status in UNKNOWN_STATUSES or status in upstream.not_processed:
            await self._unknown(
                upstream, claimed, f"re-sent; the upstream answered {status}", keep=True
            )
            return 0
        kept = body if len(body) <= self.limits.max_replay_body_bytes else None
        settled = await self.store.settle_resolution(
            claimed,
            state=RecordState.COMPLETED,
            status=status,
            headers=answer_headers,
            body=kept,
            note=f"resolved by the gateway after {claimed.attempts} re-send(s)",
            keep_request=False,
        )
        if not settled:
            return 0
        self.metrics.resolutions.labels(upstream.name, "resolved").inc()
        await self.audit.record(
            AuditEntry(
                reason=Reason.AUTO_RESOLVED.value,
                status=status,
                method=claimed.method,
                path=f"/{upstream.name}/{claimed.path}",
                job_id=claimed.job_id,
                generation=claimed.generation,
                upstream=upstream.name,
                idempotency_key=claimed.key,
                fingerprint=claimed.fingerprint,
            )
        )
        log.info(
            "resolved the unknown outcome of key %r of job %s on %s: %d",
            claimed.key,
            claimed.job_id,
            upstream.name,
            status,
        )
        return 1

    async def _unknown(
        self,
        upstream: UpstreamSettings,
        claimed: Resolution,
        note: str,
        *,
        keep: bool,
        status: int | None = None,
        outcome: str = "unknown",
    ) -> None:
        """Back to unknown: kept for another re-send, or left to an operator."""
        if keep and claimed.attempts >= self.limits.resolve_max_attempts:
            note += f"; re-sent {claimed.attempts} times: resolve it by hand"
        await self.store.settle_resolution(
            claimed,
            state=RecordState.UNKNOWN,
            status=status,
            headers=None,
            body=None,
            note=note,
            keep_request=keep,
        )
        self.metrics.resolutions.labels(upstream.name, outcome).inc()
        log.warning(
            "unknown outcome of key %r of job %s on %s: %s",
            claimed.key,
            claimed.job_id,
            upstream.name,
            note,
        )


def _headers(request: KeptRequest, upstream: UpstreamSettings) -> CIMultiDict[str]:
    """The kept headers, with the upstream's configured ones set again (from the
    configuration as it is now: a rotated credential is used)."""
    headers: CIMultiDict[str] = CIMultiDict(request.headers)
    for name, secret in upstream.set_headers.items():
        headers[name] = secret.get_secret_value()
    return headers


def kept_request(
    headers: CIMultiDict[str], upstream: UpstreamSettings, query: str, body: bytes
) -> KeptRequest:
    """What of a forwarded request is kept for a re-send: never the configured headers
    (credentials) nor the request id (a re-send gets its own)."""
    drop = upstream.set_header_names - (
        {upstream.dedup_header.lower()} if upstream.dedup_header else set()
    )
    kept = [
        (k, v) for k, v in headers.items() if k.lower() not in drop and k.lower() != "x-request-id"
    ]
    return KeptRequest(query=query, headers=kept, body=body)
