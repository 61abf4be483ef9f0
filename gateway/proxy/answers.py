"""The gateway's own answers: a problem document for each refusal, the stored answer for
a replay. Each is counted, logged and audited here, so no answer goes unrecorded."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from gateway.fencing import fence
from gateway.fencing.decision import Verdict
from gateway.fencing.fence import Reason
from gateway.fencing.machine import RequestMachine
from gateway.observe import tracing
from gateway.observe.metrics import GatewayMetrics
from gateway.proxy.incoming import Incoming
from gateway.records.audit import Audit, AuditEntry, audit_path
from lease_core.problems import problem_response

# The proxy's logger: operators filter on it for every answer the gateway gives itself.
log = logging.getLogger("fencegate.proxy")


class Answers:
    """Answers given by the gateway itself (not by an upstream)."""

    def __init__(self, audit: Audit, metrics: GatewayMetrics, *, audit_bodies: bool) -> None:
        self.audit = audit
        self.metrics = metrics
        self.audit_bodies = audit_bodies

    async def reject(
        self,
        incoming: Incoming,
        machine: RequestMachine,
        reason: Reason,
        *,
        detail: str | None = None,
        headers: dict[str, str] | None = None,
        members: dict[str, Any] | None = None,
    ) -> web.Response:
        info = fence.PROBLEMS[reason]
        if info.retry_after:
            headers = {"Retry-After": "1", **(headers or {})}
        extra = self._problem_extra(machine)
        if (
            detail is None
            and machine.admission is not None
            and machine.admission.presented is not None
        ):
            detail = machine.admission.presented.detail  # a lease source's own explanation
        self._count(incoming, machine, reason.value)
        log.info(
            "answered %s %d",
            reason.value,
            info.status,
            extra={
                "fields": {
                    "reason": reason.value,
                    "status": info.status,
                    "upstream": incoming.upstream.name if incoming.upstream else None,
                    **{k: v for k, v in extra.items() if v is not None},
                }
            },
        )
        await self._audit(incoming, machine, reason.value, info.status, extra)
        return problem_response(
            status=info.status,
            reason=reason.value,
            title=info.title,
            detail=detail or info.detail,
            headers=headers,
            **extra,
            **({"sent": info.sent.value} if info.sent is not None else {}),
            **(members or {}),
        )

    async def refuse(
        self, incoming: Incoming, machine: RequestMachine, verdict: Verdict
    ) -> web.StreamResponse:
        """A refusal the decision (or the table after the forward) gave, rendered: the
        extension members its reason shows, the connection closed where it asks."""
        reason = verdict.reason
        assert reason is not None
        members: dict[str, Any] = {}
        if reason is Reason.BODY_TOO_LARGE and incoming.upstream is not None:
            members["max_body_bytes"] = incoming.upstream.max_body_bytes
        if reason is Reason.REPLAY_UNAVAILABLE and machine.record is not None:
            members["stored_status"] = machine.record.status
        if reason is Reason.BODY_TIMEOUT:
            return await self.body_timeout(incoming, machine, reason)
        headers = {"Retry-After": "1"} if verdict.retry_after else None
        response = await self.reject(
            incoming, machine, reason, detail=verdict.detail, headers=headers, members=members
        )
        if verdict.close:
            # Malformed or ambiguous framing: nothing sent after it on the connection may
            # ever be read as a request.
            response.force_close()
        return response

    async def replay(
        self, incoming: Incoming, machine: RequestMachine, verdict: Verdict
    ) -> web.Response:
        """The key's stored answer (the table sent one kept too large to store to
        ``replay-unavailable`` instead), counted and audited under the verdict's reason."""
        record = machine.record
        assert record is not None and verdict.reason is not None
        self._count(incoming, machine, verdict.reason.value)
        await self._audit(
            incoming,
            machine,
            verdict.reason.value,
            record.status or 0,
            self._problem_extra(machine),
        )
        headers = CIMultiDict(record.headers or [])
        headers["Idempotent-Replayed"] = "true"
        return web.Response(status=record.status or 200, headers=headers, body=record.body or b"")

    async def body_timeout(
        self, incoming: Incoming, machine: RequestMachine, reason: Reason
    ) -> web.StreamResponse:
        """Nothing was claimed yet (the body is read before ``admit``). The answer is sent
        and the connection closed at once: aiohttp would otherwise keep reading the rest
        of the slow body (its lingering close) before closing."""
        response = await self.reject(incoming, machine, reason)
        response.force_close()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.prepare(incoming.request)
            await response.write_eof()
        incoming.request.protocol.force_close()
        return response

    def _count(self, incoming: Incoming, machine: RequestMachine, reason: str) -> None:
        if tracing.ENABLED:
            tracing.answered(
                reason,
                replayed=reason == Reason.IDEMPOTENT_REPLAY.value,
                presented=machine.admission.presented if machine.admission else None,
                source_name=incoming.source_name,
            )
        self.metrics.decisions.labels(
            incoming.upstream.name if incoming.upstream else "-", reason
        ).inc()
        if incoming.source_name is not None:
            self.metrics.source_decisions.labels(incoming.source_name, reason).inc()

    @staticmethod
    def _problem_extra(machine: RequestMachine) -> dict[str, Any]:
        if machine.admission is None:
            return {}
        return fence.problem_extra(machine.admission.presented, machine.admission.highest)

    async def _audit(
        self,
        incoming: Incoming,
        machine: RequestMachine,
        reason: str,
        status: int,
        extra: dict[str, Any],
    ) -> None:
        request = incoming.request
        presented = machine.admission.presented if machine.admission else None
        self.audit.record(
            AuditEntry(
                reason=reason,
                status=status,
                method=request.method,
                path=audit_path(
                    request.raw_path,
                    incoming.upstream.audit_query_params if incoming.upstream else (),
                ),
                job_id=presented.job_id if presented else None,
                generation=presented.generation if presented else None,
                highest_generation=extra.get("highest_generation"),
                owner=presented.owner if presented else None,
                upstream=incoming.upstream.name if incoming.upstream else None,
                idempotency_key=incoming.key
                if incoming.key and not fence.is_anonymous(incoming.key)
                else None,
                client=request.remote,
                fingerprint=machine.fingerprint,
                body=machine.body.getvalue()
                if machine.body is not None and self.audit_bodies
                else None,
            )
        )
