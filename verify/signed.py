"""Workers whose leases are signed tokens: the lease source ``signed`` (``kind = "jwt"``)
of the gateway replicas, with an Ed25519 key pair made for the run (``SigningKey``: the
private key in the run's folder for the workers, the public one in the replicas' config).

``SignedWorker`` (``python -m verify.worker --signed KEYFILE``) is the issuer of its own
job's grants and their holder: until SIGTERM it signs a token for the next generation of
its job (``signed/s-<worker>``; ``fencegate_client.signed.mint_token``, a TTL of
``TTL`` seconds, a ``jti`` of its own) and writes 1-3 steps with it through a gateway
replica. A signed token stays valid until it expires, whatever was signed after it: only
the gateway's fence refuses an older generation. Half of the holdings end with a
*stalled upload* (``SignedWorker.stalled``): the next step's write goes out with
``Expect: 100-continue`` and its body held back, so the gateway judges the token
(``external_lease``: nothing newer has written) and answers ``100 Continue``; while the
body waits, the next generation is signed and writes; then the body is sent. The
admission (``admit_external``) must refuse it ``stale-generation``: a newer generation of
the job has written. A gateway that admits it lowers the job's fence and forwards a
write of generation g after g+1's (invariants 1 and 6).

Recorded like the lock workers' holdings (``verify.events``): the signing is a ``claim``
(``ok`` with the generation, the TTL the token carries and ``holder``: its ``jti``), the
end of a holding a ``complete`` (the token is not used again); every event of a holding
carries ``holder``.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fencegate_client import protocol as p
from fencegate_client.signed import mint_token
from verify.events import Type, sha256_hex
from verify.worker import (
    RETRY_STATUSES,
    SOURCE_LAPSE_PAST,
    SOURCE_LAPSE_SHARE,
    SOURCE_MAX_SENDS,
    WRITE_TIMEOUT,
    History,
    SourceWorker,
)

SOURCE = "signed"  # the lease source's name at the gateway: tokens "signed:<JWS>"
ISSUER = "verify"
TTL = 10.0  # seconds a token is valid (its exp, whole seconds, may cut up to 1 s off)
STALL_SHARE = 0.5
# Of the holdings: a token of a short TTL whose holder writes once, waits past its exp
# and SOURCE_LAPSE_PAST more, and sends two more steps once each (``SignedWorker.lapse``): the
# admission must refuse them lease-expired (invariant 11). Drawn from a random of its own,
# so a seed's other draws are as before.
# SOURCE_LAPSE_SHARE and SOURCE_LAPSE_PAST: verify.worker's.
LAPSE_TTL = 2.0


class SigningKey:
    """The run's Ed25519 key pair: the private key (PEM) in ``path`` for the workers, the
    public one for the replicas' ``[[lease_sources]]``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        key = Ed25519PrivateKey.generate()
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.public_pem = (
            key.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        )

    def source_config(self) -> str:
        """The replicas' ``[[lease_sources]]`` table for it."""
        return (
            "[[lease_sources]]\n"
            f'name = "{SOURCE}"\n'
            'kind = "jwt"\n'
            'algorithms = ["EdDSA"]\n'
            f"public_keys = [{json.dumps(self.public_pem)}]\n"
            f'issuer = "{ISSUER}"\n'
        )


def signed_body(job: str, holder: str, step: int) -> bytes:
    return json.dumps({"holder": holder, "job": job, "step": step}, sort_keys=True).encode()


class Grant:
    """One signed token: its job, generation and holder (``jti``), as the history has them."""

    def __init__(
        self, job: str, generation: int, token: str, holder: str, expires: float = 0.0
    ) -> None:
        self.job = job
        self.generation = generation
        self.token = token
        self.holder = holder
        self.expires = expires  # its exp (time.time() seconds)


class SignedWorker(SourceWorker):
    """The signed-token workload of one worker process (see the module's doc)."""

    def __init__(
        self, worker_name: str, seed: str, history: History, key_file: str, gateways: list[str]
    ) -> None:
        self.private_key = Path(key_file).read_bytes()
        super().__init__(worker_name, seed, history, gateways, "signed")
        self.sub = f"s-{worker_name}"
        self.generation = 0
        self.lapse_random = random.Random(f"{seed}/{worker_name}/signed-lapse")

    @property
    def job(self) -> str:
        return f"{SOURCE}/{self.sub}"

    async def run(self) -> None:
        grant = self.sign(self.name)
        while True:
            if self.lapse_random.random() < SOURCE_LAPSE_SHARE:
                grant = await self.lapse(grant)
                continue
            gateway = self.random.choice(self.gateways)
            steps = 1 + self.random.randrange(3)
            for step in range(steps):
                await asyncio.sleep(self.random.uniform(0.02, 0.3))
                if await self.write(grant, gateway, step, self.name) != "ok":
                    break
            if self.random.random() < STALL_SHARE:
                grant = await self.stalled(grant, gateway, steps)
            else:
                self.complete(grant, self.name)
                grant = self.sign(self.name)
            await asyncio.sleep(self.random.uniform(0.05, 0.3))

    async def lapse(self, grant: Grant) -> Grant:
        """A holding whose token expires while its holder still writes: ``grant`` is
        completed, the next generation signed with a TTL of ``LAPSE_TTL``, its first
        step written, and once its exp and ``SOURCE_LAPSE_PAST`` more have passed its next two
        steps are sent; nothing newer is signed meanwhile, so only the token's expiry
        (judged by the database's clock) refuses them. The grant to go on with."""
        self.complete(grant, self.name)
        short = self.sign(self.name, ttl=LAPSE_TTL)
        gateway = self.lapse_random.choice(self.gateways)
        if await self.write(short, gateway, 0, self.name) == "ok":
            past = self.lapse_random.uniform(*SOURCE_LAPSE_PAST)
            await asyncio.sleep(max(0.0, short.expires - time.time()) + past)
            for step in (1, 2):
                if await self.write(short, gateway, step, self.name) != "ok":
                    break
        self.complete(short, self.name)
        return self.sign(self.name)

    def sign(self, process: str, ttl: float = TTL) -> Grant:
        """The next generation's token (valid ``ttl`` seconds, its exp whole seconds),
        recorded as a granted claim."""
        self.generation += 1
        holder = secrets.token_hex(8)
        self.history.invoke(process, "claim", self.job)
        now = time.time()
        token = mint_token(
            self.private_key,
            issuer=ISSUER,
            job=self.sub,
            generation=self.generation,
            ttl_seconds=ttl,
            source=SOURCE,
            owner=self.name,
            grant_id=holder,
            now=now,
        )
        expires = int(now + ttl)  # exp is whole seconds
        self.history.complete(
            process,
            "ok",
            generation=self.generation,
            status=200,
            ttl=round(expires - now, 3),
            holder=holder,
        )
        return Grant(self.job, self.generation, token, holder, expires)

    def complete(self, grant: Grant, process: str) -> None:
        """The holding is over: its token is not used again."""
        self.history.invoke(process, "complete", grant.job, grant.generation, holder=grant.holder)
        self.history.complete(process, "ok", status=200)

    async def stalled(self, grant: Grant, gateway: str, step: int) -> Grant:
        """A write of ``grant`` whose body is held back after the gateway's ``100
        Continue`` while the next generation is signed and writes; the body then goes.
        The next generation's grant, to go on with."""
        release = asyncio.Event()
        continued = asyncio.Event()
        old = asyncio.get_running_loop().create_task(
            self.write(grant, gateway, step, f"{self.name}/old", hold=(continued, release)),
            name=f"{self.name}/old",
        )
        try:
            try:
                await asyncio.wait_for(continued.wait(), WRITE_TIMEOUT)
            except TimeoutError:
                return self.sign(self.name)
            successor = self.sign(self.name)
            await self.write(successor, gateway, 0, self.name)
            return successor
        finally:
            release.set()
            await old
            self.complete(grant, f"{self.name}/old")

    async def write(
        self,
        grant: Grant,
        gateway: str,
        step: int,
        process: str,
        *,
        hold: tuple[asyncio.Event, asyncio.Event] | None = None,
    ) -> str:
        """One step's write until answered: ``ok``, or ``refused`` / ``gave-up``. With
        ``hold`` (continued, release): sent once, with ``Expect: 100-continue``; the body
        waits for ``release`` after setting ``continued`` (the gateway asked for it)."""
        history = self.history
        key = f"{grant.holder}-step{step}"
        body = signed_body(grant.job, grant.holder, step)
        headers = {
            "Content-Type": "application/json",
            p.FENCING_TOKEN: grant.token,
            p.IDEMPOTENCY_KEY: key,
        }
        timeouts = 0
        for _ in range(1 if hold else SOURCE_MAX_SENDS):
            history.invoke(
                process, "write", grant.job, grant.generation, key, sha256_hex(body),
                holder=grant.holder,
            )  # fmt: skip
            data: bytes | AsyncIterator[bytes] = body if hold is None else _held(body, *hold)
            try:
                async with self.session.post(
                    f"{gateway}/pay/charges",
                    data=data,
                    headers=headers,
                    expect100=hold is not None,
                    timeout=aiohttp.ClientTimeout(total=WRITE_TIMEOUT + (hold is not None)),
                ) as resp:
                    raw, status = await resp.read(), resp.status
                    content_type = resp.headers.get("Content-Type", "")
                    replayed = resp.headers.get(p.IDEMPOTENT_REPLAYED) == "true"
            except (aiohttp.ClientError, TimeoutError) as error:
                history.complete(process, "info", reason=type(error).__name__)
                timeouts += 1
                if timeouts >= 3 or isinstance(error, aiohttp.ClientConnectorError):
                    return "gave-up"
                continue
            finally:
                if hold is not None:
                    hold[0].set()  # refused before the body, or an error: nothing to wait for
            problem = p.problem_of(content_type, raw)
            reason = str(problem["reason"]) if problem else None
            type_: Type = "ok" if 200 <= status <= 299 else "fail"
            history.complete(
                process, type_, status=status, reason=reason, body_sha256=sha256_hex(raw),
                replayed=replayed if type_ == "ok" else None,
            )  # fmt: skip
            if type_ == "ok":
                return "ok"
            if status not in RETRY_STATUSES:
                return "refused"
            await asyncio.sleep(self.random.uniform(0.05, 0.2))
        return "gave-up"


async def _held(
    body: bytes, continued: asyncio.Event, release: asyncio.Event
) -> AsyncIterator[bytes]:
    """The body, sent once ``release`` is set; ``continued`` is set when it is asked for
    (aiohttp reads it only after the ``100 Continue``)."""
    continued.set()
    await release.wait()
    yield body
