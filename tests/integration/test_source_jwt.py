"""Signed fencing tokens (a ``kind = "jwt"`` lease source), over real HTTP, on SQLite and
PostgreSQL: the same table, ordering, idempotency, audit and metrics as the gateway's
own leases, and every malformed, forged or foreign token refused before the upstream."""

from __future__ import annotations

from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from fencegate_client.signed import mint_token
from tests.gateway_helpers import ok, problem
from tests.support import FakeClock, Upstream, upstream_config

ISSUER = "billing-queue"


def pem_pair(kind: str = "ed25519") -> tuple[str, str]:
    private: Any = (
        ed25519.Ed25519PrivateKey.generate()
        if kind == "ed25519"
        else ec.generate_private_key(ec.SECP256R1())
    )
    private_pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public_pem = (
        private.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    return private_pem, public_pem


PRIVATE, PUBLIC = pem_pair()


def source_config(public: str = PUBLIC, **extra: Any) -> dict[str, Any]:
    return {
        "name": "queue",
        "kind": "jwt",
        "algorithms": ["EdDSA"],
        "public_keys": [public],
        "issuer": ISSUER,
        **extra,
    }


class Queue:
    """Stands in for the queue that grants leases: it signs one token per grant."""

    def __init__(self, clock: FakeClock, private: str = PRIVATE) -> None:
        self.clock = clock
        self.private = private

    def token(self, job: str, generation: int, ttl: float = 30, **kw: Any) -> str:
        return mint_token(
            self.private,
            source="queue",
            issuer=kw.pop("issuer", ISSUER),
            job=job,
            generation=generation,
            ttl_seconds=ttl,
            now=self.clock.now,
            **kw,
        )


def lease(token: str) -> dict[str, Any]:
    return {"lease_token": token}


@pytest.fixture
async def setup(make_stack: Any, upstream: Upstream, clock: FakeClock) -> tuple[Any, Queue]:
    stack = await make_stack(upstreams=[upstream_config(upstream)], lease_sources=[source_config()])
    return stack, Queue(clock)


async def test_a_lower_generation_is_refused_after_a_higher_one_wrote(
    setup: tuple[Any, Queue], upstream: Upstream
) -> None:
    stack, queue = setup
    first, second = queue.token("order-42", 1), queue.token("order-42", 2)
    await ok(await stack.write("/pay/charges", lease(first), key="step-1"))
    sent = upstream.received[0]["headers"]
    assert (sent["Fencing-Job"], sent["Fencing-Generation"]) == ("queue/order-42", "1")
    assert "Fencing-Token" not in sent
    await ok(await stack.write("/pay/charges", lease(second), key="step-2"))
    # The first worker wakes up and writes late: refused, nothing forwarded.
    doc = await problem(
        await stack.write("/pay/charges", lease(first), key="step-3"), 409, "stale-generation"
    )
    assert (doc["job_id"], doc["generation"], doc["highest_generation"]) == (
        "queue/order-42",
        1,
        2,
    )
    assert [r["generation"] for r in upstream.received] == ["1", "2"]
    # A token minted with a higher generation fences the second off in turn.
    await ok(await stack.write("/pay/charges", lease(queue.token("order-42", 7)), key="s4"))
    await problem(
        await stack.write("/pay/charges", lease(second), key="s5"), 409, "stale-generation"
    )
    # The audit and the metrics name the source.
    entries = await stack.audit(job_id="queue/order-42")
    assert {e["reason"] for e in entries} == {"stale-generation"}
    metrics = await (await stack.control.get("/metrics")).text()
    series = "fencegate_gateway_source_decisions_total"
    assert f'{series}{{reason="forwarded",source="queue"}} 3.0' in metrics
    assert f'{series}{{reason="stale-generation",source="queue"}} 2.0' in metrics


async def test_generation_zero_is_a_generation(
    setup: tuple[Any, Queue], upstream: Upstream
) -> None:
    """A token of generation 0 (the lowest a signed token may carry) writes, and is fenced
    off by generation 1 like any other."""
    stack, queue = setup
    zero, one = queue.token("order-0", 0), queue.token("order-0", 1)
    await ok(await stack.write("/pay/charges", lease(zero), key="step-1"))
    await ok(await stack.write("/pay/charges", lease(one), key="step-2"))
    await problem(
        await stack.write("/pay/charges", lease(zero), key="step-3"), 409, "stale-generation"
    )
    assert [r["generation"] for r in upstream.received] == ["0", "1"]


async def test_expired_tokens_by_the_database_clock(
    setup: tuple[Any, Queue], upstream: Upstream, clock: FakeClock
) -> None:
    stack, queue = setup
    token = queue.token("job-e", 1, ttl=10)
    clock.advance(11)
    doc = await problem(await stack.write("/pay/x", lease(token), key="k"), 409, "lease-expired")
    assert (doc["job_id"], doc["generation"]) == ("queue/job-e", 1)
    # Once a newer generation has written, the expired one is stale (the table's order).
    await ok(await stack.write("/pay/x", lease(queue.token("job-e", 2)), key="k"))
    await problem(await stack.write("/pay/x", lease(token), key="k2"), 409, "stale-generation")
    assert [r["generation"] for r in upstream.received] == ["2"]


async def test_forged_foreign_and_malformed_tokens_are_invalid(
    setup: tuple[Any, Queue], upstream: Upstream, clock: FakeClock
) -> None:
    stack, queue = setup
    other_private, _ = pem_pair()
    ec_private, _ = pem_pair("ec")
    now = int(clock.now)
    good = {"iss": ISSUER, "sub": "job-x", "gen": 1, "exp": now + 30}
    tokens = {
        "wrong issuer": queue.token("job-x", 1, issuer="someone-else"),
        "bad signature": Queue(clock, other_private).token("job-x", 1),
        "wrong algorithm": "queue:" + jwt.encode(good, ec_private, algorithm="ES256"),
        "HS256 with the public key": "queue:" + jwt.encode(good, "k" * 32, algorithm="HS256"),
        "gen null": "queue:" + jwt.encode({**good, "gen": None}, PRIVATE, algorithm="EdDSA"),
        "gen true": "queue:" + jwt.encode({**good, "gen": True}, PRIVATE, algorithm="EdDSA"),
        "no gen": "queue:"
        + jwt.encode({k: v for k, v in good.items() if k != "gen"}, PRIVATE, algorithm="EdDSA"),
        "no sub": "queue:"
        + jwt.encode({k: v for k, v in good.items() if k != "sub"}, PRIVATE, algorithm="EdDSA"),
        "no exp": "queue:"
        + jwt.encode({k: v for k, v in good.items() if k != "exp"}, PRIVATE, algorithm="EdDSA"),
        "no iss": "queue:"
        + jwt.encode({k: v for k, v in good.items() if k != "iss"}, PRIVATE, algorithm="EdDSA"),
        "gen as text": "queue:" + jwt.encode({**good, "gen": "1"}, PRIVATE, algorithm="EdDSA"),
        "negative gen": "queue:" + jwt.encode({**good, "gen": -1}, PRIVATE, algorithm="EdDSA"),
        "unsigned": "queue:" + jwt.encode(good, None, algorithm="none"),
        "not a JWS": "queue:not-a-token",
        "unknown source": "elsewhere:" + queue.token("job-x", 1).partition(":")[2],
        "sub too long": queue.token("j" * 300, 1),
    }
    for name, token in tokens.items():
        resp = await stack.write("/pay/x", lease(token), key="k")
        doc = await problem(resp, 403, "invalid-fencing-token")
        assert "job_id" not in doc or doc["job_id"] is None, name
    assert upstream.received == []
    # The good token still writes.
    await ok(await stack.write("/pay/x", lease(queue.token("job-x", 1)), key="k"))


async def test_replays_and_key_reuse_across_generations(
    setup: tuple[Any, Queue], upstream: Upstream
) -> None:
    stack, queue = setup
    first, second = queue.token("job-r", 3), queue.token("job-r", 4)
    body = await ok(await stack.write("/pay/charges", lease(first), key="charge"))
    # The next grant's worker repeats the step: the stored answer, the upstream not called.
    resp = await stack.write("/pay/charges", lease(second), key="charge")
    assert resp.status == 201 and resp.headers["Idempotent-Replayed"] == "true"
    assert await resp.read() == body
    await problem(
        await stack.write("/pay/charges", lease(second), key="charge", body={"amount": 9}),
        422,
        "idempotency-key-reused",
    )
    assert len(upstream.received) == 1
    assert [e["reason"] for e in await stack.audit(job_id="queue/job-r")] == [
        "idempotency-key-reused",
        "idempotent-replay",
    ]


async def test_jobs_of_different_sources_never_collide(
    setup: tuple[Any, Queue], upstream: Upstream
) -> None:
    stack, queue = setup
    own = await stack.lease("order-42")
    assert own["generation"] == 1
    # The queue's order-42 at generation 9 does not fence lease_core's order-42 off...
    await ok(await stack.write("/pay/x", lease(queue.token("order-42", 9)), key="k"))
    await ok(await stack.write("/pay/x", own, key="k"))
    # ... nor do their keys meet: each had its own "k", each forwarded once.
    assert [(r["headers"]["Fencing-Job"], r["generation"]) for r in upstream.received] == [
        ("queue/order-42", "9"),
        ("order-42", "1"),
    ]
    # A lease_core job whose id looks like a prefixed one stays lease_core's.
    look_alike = await stack.lease("queue:order-42")
    await ok(await stack.write("/pay/x", look_alike, key="k"))


async def test_a_key_rotation_accepts_either_key(
    make_stack: Any, upstream: Upstream, clock: FakeClock
) -> None:
    new_private, new_public = pem_pair()
    stack = await make_stack(
        upstreams=[upstream_config(upstream)],
        lease_sources=[source_config(public_keys=[PUBLIC, new_public])],
    )
    await ok(await stack.write("/pay/x", lease(Queue(clock).token("j", 1)), key="a"))
    await ok(await stack.write("/pay/x", lease(Queue(clock, new_private).token("j", 2)), key="b"))
    assert len(upstream.received) == 2
