"""``[gateway]``: the gateway's own behaviour and limits (retention, the HTTP servers'
limits, concurrency, timeouts, replay and resolution)."""

from __future__ import annotations

import re
import socket

from pydantic import BaseModel, ConfigDict, Field

# A replica's name, as the audit keeps it: letters, digits and ``._:-``.
REPLICA_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$"
MAX_REPLICA_NAME = 100


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ordering_wait_seconds: float = Field(5.0, ge=0, le=300, allow_inf_nan=False)
    idempotency_retention_seconds: float = Field(86400.0, gt=0, allow_inf_nan=False)
    audit_retention_days: float = Field(30.0, gt=0, allow_inf_nan=False)
    audit_bodies: bool = False
    # Requests refused without a lease behind them (no token, a made-up one, an unknown
    # upstream, ...) are counted in grouped rows: per bucket, at most ``groups`` rows
    # per replica (then one overflow row per reason), kept a shorter time.
    audit_unauthenticated_retention_days: float = Field(1.0, gt=0, allow_inf_nan=False)
    audit_unauthenticated_bucket_seconds: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False)
    audit_unauthenticated_groups: int = Field(100, ge=1, le=100_000)
    purge_interval_seconds: float = Field(60.0, gt=0, allow_inf_nan=False)
    max_idempotency_key_length: int = Field(255, ge=1, le=255)
    # Limits of the HTTP servers (both listeners) and of the gateway's own resources.
    max_request_line_bytes: int = Field(8190, ge=256, le=65536)
    max_header_field_bytes: int = Field(8190, ge=256, le=65536)
    max_headers: int = Field(128, ge=8, le=1024)
    # Fenced writes whose lease was found current (or whose body had all arrived), and,
    # separately, unfenced requests: neither kind can take the other's slots, and a
    # request with an unknown token takes none while its body is still arriving.
    max_concurrent_requests: int = Field(1024, ge=1, le=100_000)
    max_concurrent_unfenced_requests: int = Field(1024, ge=1, le=100_000)
    # A proxied request's body must arrive within body_timeout_seconds of its head, and
    # no read of it may wait longer than body_idle_timeout_seconds (408 body-timeout).
    body_timeout_seconds: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    body_idle_timeout_seconds: float = Field(15.0, gt=0, le=3600, allow_inf_nan=False)
    upstream_connections_per_host: int = Field(256, ge=1, le=10_000)
    keepalive_timeout_seconds: float = Field(75.0, gt=0, le=3600, allow_inf_nan=False)
    # How long an idle connection to an upstream is kept for reuse. Keep it below the
    # upstream's own idle timeout: a write sent on a connection that the upstream closed
    # meanwhile is never re-sent, so its outcome is unknown.
    upstream_keepalive_seconds: float = Field(4.0, gt=0, le=3600, allow_inf_nan=False)
    # The largest answer head read from an upstream (status line and headers, with those
    # of 1xx answers before it); a larger one is not read: no answer, an unknown outcome.
    max_upstream_head_bytes: int = Field(65536, ge=1024, le=1024 * 1024)
    shutdown_timeout_seconds: float = Field(15.0, ge=0, le=600, allow_inf_nan=False)
    # Answers up to this size are stored for replay; a duplicate of a larger one gets
    # 409 replay-unavailable (the write was applied; its body was not kept).
    max_replay_body_bytes: int = Field(1024 * 1024, ge=0, le=64 * 1024 * 1024)
    # Unknown outcomes of upstreams with ``unknown_outcome = "resolve"``: how often the
    # background task looks for them, and how many re-sends one gets before it is left to
    # an operator. Their requests are kept up to ``max_replay_body_bytes``.
    resolve_interval_seconds: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False)
    resolve_max_attempts: int = Field(5, ge=1, le=100)
    # ``Prefer: wait=N`` on a fenced write whose key is in flight: the longest wait for
    # the first attempt to settle before ``request-in-progress`` (0: never wait).
    max_prefer_wait_seconds: int = Field(10, ge=0, le=300)
    # A final answer's record is settled behind the answer (False, the default: the
    # client does not wait for the database, and a duplicate that this replica admits
    # meanwhile waits for the settle), or before its last byte goes out (True: a
    # duplicate sent to any replica after the answer finds it stored).
    settle_before_answer: bool = False
    # A forwarded fenced write's answer carries a ``Server-Timing`` header (W3C): the
    # seconds of each of its steps in the gateway, the upstream's and the gateway's total.
    server_timing: bool = False
    # The name this replica writes into the audit entries it makes (the ``replica``
    # column): None, the default, is the machine's hostname (a container's: its pod's).
    replica_name: str | None = Field(None, pattern=REPLICA_NAME)

    @property
    def replica(self) -> str:
        """``replica_name``, or the hostname made into one."""
        if self.replica_name is not None:
            return self.replica_name
        return hostname_replica(socket.gethostname())


def hostname_replica(host: str) -> str:
    """A hostname as a replica name: characters the name cannot hold become ``-``, at
    most its first 100 characters; ``fencegate`` when nothing is left."""
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", host)[:MAX_REPLICA_NAME]
    name = name.lstrip("._:-")
    return name or "fencegate"
