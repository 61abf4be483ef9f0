"""No secret reaches a log record, an answer, the audit or ``/metrics``: control tokens
(well-formed, malformed, unknown), lease tokens, upstream header values and request
bodies, with every logger at DEBUG (SQLAlchemy's and aiosqlite's statement logging
included), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.records.schema import audit
from tests.support import Upstream, upstream_config

ADMIN = "admin-tok-secret-1111111111"
WORKER = "worker-tok-secret-2222222222"
UNKNOWN = "made-up-but-well-formed-3333333333"
PAY_KEY = "sk_live_pay_secret_44444444"
BODY = "card-number-body-secret-55555555"
URL_PASSWORD = "url-password-secret-666666"

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def record_text(record: logging.LogRecord) -> str:
    """Everything a handler could write of a record: its message, arguments, traceback,
    stack and extra fields."""
    parts = [record.getMessage(), repr(record.msg), repr(record.args)]
    if record.exc_info and record.exc_info[1] is not None:
        parts.append("".join(traceback.format_exception(*record.exc_info)))
    parts += [record.exc_text or "", record.stack_info or ""]
    parts += [repr(v) for k, v in record.__dict__.items() if k not in _STANDARD]
    return "\n".join(parts)


async def raw(host: str, port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


@pytest.mark.parametrize("audit_bodies", [False, True])
async def test_no_secret_in_logs_answers_audit_or_metrics(
    make_stack: Any,
    upstream: Upstream,
    engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
    audit_bodies: bool,
) -> None:
    caplog.set_level(logging.DEBUG)
    # SQLAlchemy keeps its own loggers at WARNING; an operator debugging turns them up
    # (as ``echo=True`` or ``echo="debug"`` would): statements, parameters, rows.
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.engine")
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.pool")
    stack = await make_stack(
        gateway={"audit_bodies": audit_bodies},
        auth={"admin_tokens": [ADMIN], "worker_tokens": [WORKER]},
        upstreams=[
            upstream_config(
                upstream,
                set_headers={"Authorization": f"Bearer {PAY_KEY}", "X-Api-Key": PAY_KEY},
            ),
            # A second upstream reached through a URL with a password in it.
            {
                "name": "other",
                "url": upstream.url.replace("http://", f"http://user:{URL_PASSWORD}@"),
            },
        ],
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    worker = {"Authorization": f"Bearer {WORKER}"}
    answers: list[str] = []
    host, port = stack.control.server.host, stack.control.server.port

    # Malformed, unknown and misplaced control tokens, on the raw wire.
    for value in (
        f"Bearer {ADMIN}\x01".encode(),  # refused by the HTTP parser
        f"Bearer {WORKER}\x7f".encode(),
        ADMIN.encode(),  # no scheme
        f"Basic {ADMIN}".encode(),
        f"Bearer  {ADMIN} trailing".encode(),
        f"Bearer {UNKNOWN}".encode(),
        f"Bearer {ADMIN}".encode() + b"\xff\xfe",
        f"Bearer {WORKER}".encode(),  # a worker token on an admin path
    ):
        answer = await raw(
            host,
            port,
            b"GET /admin/upstreams HTTP/1.1\r\nHost: x\r\nAuthorization: "
            + value
            + b"\r\nConnection: close\r\n\r\n",
        )
        assert answer.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), answer[:100]
        if answer.startswith(b"HTTP/1.1"):
            answers.append(answer.decode("latin-1").split("\r\n\r\n", 1)[1])
        # else: refused by aiohttp's HTTP parser, whose plain-text 400 quotes the
        # offending line back to its sender (and to nobody else); THREAT_MODEL.md.

    # Valid tokens, a lease, fenced writes with bodies; a replay, a stale write and a bad
    # body in the lease API.
    resp = await stack.control.put(
        "/v1/jobs/job-1/lease", json={"owner": "w", "ttl_seconds": 30}, headers=worker
    )
    assert resp.status == 201
    lease = await resp.json()
    token = lease["lease_token"]
    body = {"card": BODY, "amount": 5}
    for key in ("k1", "k1", "k2"):
        resp = await stack.write("/pay/charges", lease, key=key, body=body)
        answers.append(await resp.text())
    assert upstream.received[0]["headers"]["Authorization"] == f"Bearer {PAY_KEY}"
    resp = await stack.write("/other/charges", lease, key="k3", body=body)
    answers.append(await resp.text())
    resp = await stack.control.put(
        "/v1/jobs/job-1/lease", json={"owner": "w", "ttl_seconds": 30}, headers=worker
    )
    assert resp.status == 201
    newer = await resp.json()
    resp = await stack.write("/pay/charges", lease, key="k4", body=body)  # stale now
    assert resp.status == 409
    answers.append(await resp.text())
    for payload in (
        {"lease_token": token, "ttl_seconds": "x", "note": BODY},
        {"lease_token": token + BODY},
        {"lease_token": newer["lease_token"], "ttl_seconds": -1},
    ):
        resp = await stack.control.post("/v1/leases/renew", json=payload, headers=worker)
        assert resp.status in (400, 403, 409)
        answers.append(await resp.text())
    resp = await stack.proxy.post(
        "/pay/charges",
        data=b"{" + BODY.encode() + b"\x00\xff",
        headers={"Fencing-Token": newer["lease_token"] + "!", "Idempotency-Key": "k5"},
    )
    answers.append(await resp.text())
    for path in ("/admin/upstreams", "/admin/rejections", "/admin/unknown-outcomes"):
        resp = await stack.control.get(path, headers=admin)
        assert resp.status == 200
        answers.append(await resp.text())
    resp = await stack.control.get("/metrics", headers=admin)
    assert resp.status == 200
    metrics = await resp.text()

    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(audit))).all()
    assert rows, "the refused writes were audited"
    audited = "\n".join(repr(tuple(row)) for row in rows)

    logged = "\n".join(record_text(r) for r in caplog.records)
    assert any(r.name.startswith("sqlalchemy.engine") for r in caplog.records)
    secrets = [ADMIN, WORKER, UNKNOWN, PAY_KEY, BODY, URL_PASSWORD]
    lease_tokens = [token, newer["lease_token"], token[4:], newer["lease_token"][4:]]
    for secret in [*secrets, *lease_tokens]:
        assert secret not in logged, (
            secret,
            [line for line in logged.splitlines() if secret in line][:3],
        )
        if not (audit_bodies and secret == BODY):  # audited as configured
            assert secret not in audited, secret
        assert secret not in metrics, secret
    for secret in [*secrets, *lease_tokens]:
        for answer in answers:
            assert secret not in answer, (secret, answer[:300])


ZK_PASSWORD = "zk-digest-secret-77777777"
REDIS_PASSWORD = "redis-acl-secret-88888888"
REDIS_URL_PASSWORD = "redis-url-secret-99999999"
ETCD_PASSWORD = "etcd-user-secret-10101010"


async def test_no_lease_source_password_in_logs_answers_audit_or_readyz(
    make_stack: Any,
    upstream: Upstream,
    engine: AsyncEngine,
    caplog: pytest.LogCaptureFixture,
    zookeeper_hosts: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The lease sources' passwords (ZooKeeper's digest, a Redis ACL user's in the
    settings and in a URL, an etcd user's), with every logger at its lowest level (kazoo
    logs the packets it sends): a source that answers and admits a write, one that
    refuses the credentials, one that does not answer."""
    from kazoo.client import KazooClient

    from fencegate_client.zookeeper import lock_token
    from tests.support import RedisServer, free_port

    caplog.set_level(1)
    redis_server = RedisServer(
        tmp_path_factory.mktemp("redis-acl"),
        users=[f"gateway on >{REDIS_PASSWORD} ~* +@all"],
    )
    try:
        stack = await make_stack(
            upstreams=[upstream_config(upstream)],
            lease_sources=[
                {
                    "name": "zk",
                    "kind": "zookeeper",
                    "hosts": [zookeeper_hosts],
                    "username": "gateway",
                    "password": ZK_PASSWORD,
                },
                {
                    "name": "locks",
                    "kind": "redis",
                    "url": redis_server.url,
                    "username": "gateway",
                    "password": REDIS_PASSWORD,
                },
                {
                    "name": "etcd",
                    "kind": "etcd",
                    "endpoints": [f"http://127.0.0.1:{free_port()}"],
                    "username": "gateway",
                    "password": ETCD_PASSWORD,
                    "timeout_seconds": 0.5,
                },
            ],
        )
        worker = KazooClient(hosts=zookeeper_hosts)
        await asyncio.to_thread(worker.start, 10)
        try:
            lock = worker.Lock("/locks/secret-test", "w")
            assert await asyncio.to_thread(lock.acquire, True, 10)
            answers = []
            resp = await stack.write("/pay/charges", {"lease_token": lock_token(lock, source="zk")})
            assert resp.status == 201, await resp.text()
            for token in ("locks:order-1:1.abcdefabcdefabcdef", "etcd:/locks/x/694d7c1e2a3b4c5d"):
                resp = await stack.write("/pay/charges", {"lease_token": token}, key="k2")
                answers.append(await resp.text())
            await asyncio.to_thread(lock.release)
        finally:
            worker.stop()
            worker.close()
        for path in ("/readyz", "/healthz", "/admin/upstreams", "/metrics"):
            resp = await stack.control.get(path)
            answers.append(await resp.text())
        await stack.written()
    finally:
        redis_server.stop()

    async with engine.connect() as conn:
        audited = "\n".join(repr(tuple(r)) for r in (await conn.execute(sa.select(audit))).all())
    logged = "\n".join(record_text(r) for r in caplog.records)
    assert any(r.name.startswith("kazoo") for r in caplog.records)
    assert "etcd" in logged  # the unreachable etcd was logged, without its password
    for secret in (ZK_PASSWORD, REDIS_PASSWORD, ETCD_PASSWORD):
        assert secret not in logged, [line for line in logged.splitlines() if secret in line][:3]
        assert secret not in audited
        for answer in answers:
            assert secret not in answer, answer[:300]

    # A Redis URL with a password in it is a secret of the configuration too.
    from gateway.config import Settings

    settings = Settings(
        database_url="sqlite+aiosqlite:////tmp/x.db",
        lease_sources=[
            {
                "name": "locks",
                "kind": "redis",
                "url": f"redis://gateway:{REDIS_URL_PASSWORD}@127.0.0.1:1/0",
            }
        ],
    )
    assert REDIS_URL_PASSWORD in settings.secret_values()
