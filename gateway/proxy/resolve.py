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
from dataclasses import dataclass, replace

from multidict import CIMultiDict

from gateway.config import GatewaySettings, UpstreamSettings
from gateway.fencing import resolution
from gateway.fencing.deadlines import resolve_claim_seconds, resolve_window
from gateway.fencing.fence import RecordState, UnknownOutcome
from gateway.fencing.profiles import is_mismatch, upstream_key
from gateway.fencing.resolution import Settled
from gateway.observe.metrics import GatewayMetrics
from gateway.records.audit import Audit, AuditEntry
from gateway.records.store import GatewayStore, KeptRequest, Resolution
from gateway.upstream import UpstreamError, s3
from gateway.upstream.forwarding import Forwarder, answer_headers, upstream_url, why_no_answer

log = logging.getLogger("fencegate.resolve")


@dataclass(frozen=True, slots=True)
class ObjectState:
    """What a HEAD says of the object a held S3 write was for."""

    written: bool  # its metadata names this write's key and generation
    headers: list[tuple[str, str]]  # its ETag and version id: the stored answer's
    precondition: dict[str, str]  # for a re-send: If-None-Match: * or If-Match: <etag>


# Seconds between two re-sends of one record (its claim's ``pause``).
PAUSE = 1.0
# Records one round resolves per upstream at most (the next round goes on).
ROUND = 50


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
        if not self.forwarder.started:  # the proxy listener is not up (yet)
            return 0
        settled = 0
        for upstream in list(self.upstreams().values()):
            if upstream.unknown_outcome != UnknownOutcome.RESOLVE or upstream.dedup is None:
                continue
            for _ in range(ROUND):
                claimed = await self.store.claim_resolution(
                    upstream.name,
                    window=resolve_window(upstream.dedup.window_seconds, upstream.timeout_seconds),
                    max_attempts=self.limits.resolve_max_attempts,
                    pause=PAUSE,
                    deadline_in=resolve_claim_seconds(
                        upstream.timeout_seconds, upstream.connect_timeout_seconds
                    ),
                )
                if claimed is None:
                    break
                settled += await self.resolve(upstream, claimed)
        return settled

    async def resolve(self, upstream: UpstreamSettings, claimed: Resolution) -> int:
        """Re-send one claimed record and settle it; 1 when it got its answer."""
        claim = await self.store.claim(claimed.job_id, claimed.key, claimed.attempt)
        settled = resolution.before_resend(claimed.generation, claim)
        if settled is None:
            settled = await self._resend(upstream, claimed)
        return await self._settle(upstream, claimed, settled)

    async def _resend(self, upstream: UpstreamSettings, claimed: Resolution) -> Settled:
        """The object's state first (S3: written already, or the precondition for a safe
        re-send), then the re-send; what its answer makes of the record."""
        extra: dict[str, str] = {}
        if upstream.signing is not None:
            found = await self._object_state(upstream, claimed)
            if isinstance(found, str):
                return Settled(RecordState.UNKNOWN, "unknown", found, keep=True)
            if found.written:
                how = "the object carries this write's fencing metadata (HEAD)"
                return replace(resolution.written(how), answer=(200, found.headers, b""))
            extra = found.precondition
        answer = await self._send(upstream, claimed, extra)
        if isinstance(answer, str):
            return Settled(RecordState.UNKNOWN, "unknown", answer, keep=True)
        status, _, body = answer
        dedup = upstream.dedup
        assert dedup is not None
        mismatch = is_mismatch(status, body, dedup.mismatch_status, dedup.mismatch_contains)
        # ``precondition``: the one the gateway added after its HEAD (``extra``).
        answered = upstream.answer_of(status, precondition=bool(extra))
        return replace(resolution.after_resend(status, answered, mismatch=mismatch), answer=answer)

    async def _settle(
        self, upstream: UpstreamSettings, claimed: Resolution, settled: Settled
    ) -> int:
        if settled.resolved:
            assert settled.answer is not None
            return await self._completed(upstream, claimed, settled)
        await self._unknown(upstream, claimed, settled)
        return 0

    async def _send(
        self, upstream: UpstreamSettings, claimed: Resolution, extra: Mapping[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes] | str:
        """Re-send the kept request (signed again for S3, with ``extra`` headers: a
        precondition); its answer, or why there is none."""
        headers = _headers(claimed.request, upstream)
        for name, value in extra.items():
            headers.setdefault(name, value)  # a worker's own precondition stays
        method = claimed.method.split(" as ")[0]
        return await self._exchange(upstream, method, claimed, headers, claimed.request.body)

    async def _exchange(
        self,
        upstream: UpstreamSettings,
        method: str,
        claimed: Resolution,
        headers: CIMultiDict[str],
        body: bytes,
    ) -> tuple[int, list[tuple[str, str]], bytes] | str:
        client = self.forwarder.client
        assert client is not None
        url = upstream_url(upstream, claimed.path, claimed.request.query)
        if upstream.signing is not None:
            s3.sign(headers, method, url, body, upstream.signing)
        try:
            async with await client.request(
                method,
                url,
                headers.items(),
                body,
                timeout=upstream.timeout_seconds,
                connect_timeout=upstream.connect_timeout_seconds,
            ) as response:
                content = await response.read()
                return response.status, answer_headers(response.headers), content
        except UpstreamError as error:
            return f"{method} sent again, no answer: {why_no_answer(error)}"

    async def _object_state(
        self, upstream: UpstreamSettings, claimed: Resolution
    ) -> ObjectState | str:
        """HEAD of the object a kept S3 write was for: written by this write (its key
        and generation in the metadata), or the precondition for a safe re-send."""
        answer = await self._exchange(upstream, "HEAD", claimed, CIMultiDict(), b"")
        if isinstance(answer, str):
            return answer
        status, headers, _ = answer
        found = CIMultiDict(headers)
        if status == 404:
            return ObjectState(False, [], {"If-None-Match": "*"})
        if status != 200:
            return f"HEAD of the object answered {status}"
        expected = upstream_key(claimed.job_id, claimed.key)
        written = found.get(s3.META_KEY) == expected and found.get(s3.META_GENERATION) == str(
            claimed.generation
        )
        kept = [(k, v) for k, v in headers if k.lower() in ("etag", "x-amz-version-id")]
        etag = found.get("ETag")
        return ObjectState(written, kept, {"If-Match": etag} if etag else {})

    async def _completed(
        self, upstream: UpstreamSettings, claimed: Resolution, settled: Settled
    ) -> int:
        """Store the answer as the key's, audited as resolved; 1 when stored."""
        assert settled.answer is not None and settled.reason is not None
        status, answer_headers, body = settled.answer
        kept = body if len(body) <= self.limits.max_replay_body_bytes else None
        stored = await self.store.settle_resolution(
            claimed,
            state=RecordState.COMPLETED,
            status=status,
            headers=answer_headers,
            body=kept,
            note=f"resolved by the gateway ({settled.note}; attempt {claimed.attempts})",
            keep_request=False,
        )
        if not stored:
            return 0
        self.metrics.resolutions.labels(upstream.name, settled.outcome).inc()
        self.audit.record(
            AuditEntry(
                reason=settled.reason.value,
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
        self, upstream: UpstreamSettings, claimed: Resolution, settled: Settled
    ) -> None:
        """Back to unknown: kept for another re-send, or left to an operator."""
        note = settled.note
        if settled.keep and claimed.attempts >= self.limits.resolve_max_attempts:
            note += f"; re-sent {claimed.attempts} times: resolve it by hand"
        await self.store.settle_resolution(
            claimed,
            state=RecordState.UNKNOWN,
            status=settled.status,
            headers=None,
            body=None,
            note=note,
            keep_request=settled.keep,
        )
        self.metrics.resolutions.labels(upstream.name, settled.outcome).inc()
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
