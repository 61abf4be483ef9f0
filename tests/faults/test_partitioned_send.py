"""A write the gateway has sent into a partition must not reach the upstream after the
gateway let go of it: after it gave up waiting (its upstream timeout), after its process
was killed, or while its process is frozen past the exchange's deadline.

Found by ``verify run --db sqlite --nemesis all --resolving --seed 512142473``: a replica
sent a write of generation 70 while a partition dropped its packets to the upstream, was
stopped (the clock nemesis's restart), and the kernel went on retransmitting the dead
process's request; the partition healed 5 s later and the upstream applied it after
generation 73 had written. Closing a socket (or a process ending) does not take back what
the kernel still holds to send: it is retransmitted for minutes. The gateway now drops an
upstream connection with a reset (``SO_LINGER`` 0: the unsent bytes are discarded) and
lets the kernel hold a request's bytes only until the exchange's deadline
(``TCP_USER_TIMEOUT``), so a frozen process cannot send them late either.

Real processes: ``fencegate serve`` in a network namespace of its own (``verify.netns``),
``verify.upstream`` on the host side recording every write it receives; the partition is
an iptables rule in the namespace.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.support import namespace_for_test
from verify import netns, stack

from .harness import PAY, ProcessGroup, Replica, acquire, http, write_config

# The gateway's timeout for the upstream (PAY's: 1 s). TCP's first retransmissions come
# 0.2-0.4 s, then about 0.6, 1.4, 3 and 6 s after the send: a write cut for 2 s and healed
# is retransmitted within 6 s of the heal, when the kernel still holds it.
CUT_SECONDS = 2.0
AFTER_HEAL_SECONDS = 6.0
TOKEN = "worker-token-0123456789"  # off loopback, the gateway asks for one


@pytest.fixture
def namespace() -> Iterator[netns.Namespace]:
    with namespace_for_test("send", 221, 9) as ns:
        yield ns


async def start(group: ProcessGroup, ns: netns.Namespace) -> tuple[stack.Upstream, Replica, Path]:
    """The recording upstream on the host side and one replica inside ``ns``."""
    received = group.folder / "received.jsonl"
    upstream = await stack.start_upstream(
        group,
        group.folder / "ledger.jsonl",
        hosts=(ns.host_addr,),
        received=received,
    )
    config = write_config(
        group.folder,
        "sqlite+aiosqlite:///" + str(group.folder / "fencegate.db"),
        f"http://{ns.host_addr}:{upstream.port}",
        (PAY,),
        extra=f'[auth]\nworker_tokens = ["{TOKEN}"]\n',
    )
    config.write_text(config.read_text().replace("127.0.0.1:0", f"{ns.addr}:0"))
    replica = Replica("replica", config, ns.addr, 0, 0, ns, group)
    await replica.start()
    return upstream, replica, received


def received_keys(received: Path) -> list[str]:
    if not received.exists():
        return []
    return [json.loads(line)["key"] for line in received.read_text().splitlines() if line]


@pytest.mark.parametrize("let_go", ["timeout", "kill", "freeze"])
async def test_a_write_cut_off_never_reaches_the_upstream_after_the_gateway_let_go(
    group: ProcessGroup, namespace: netns.Namespace, let_go: str
) -> None:
    upstream, replica, received = await start(group, namespace)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=auth) as session:
        lease = await acquire(session, replica, "order-1", "w1", ttl=60)
        headers = {"Fencing-Token": lease["lease_token"], "Content-Type": "application/json"}
        url = f"{replica.proxy}/{PAY.name}/charges"
        # A first write: the replica keeps its connection to the upstream open.
        first = await http(
            session, "POST", url, data=b"{}", headers=headers | {"Idempotency-Key": "first"}
        )
        assert first.status == 201, first
        assert received_keys(received) == ["first"]

        namespace.cut(upstream.port)
        cut_at = time.monotonic()
        write = asyncio.ensure_future(
            http(
                session,
                "POST",
                url,
                data=b'{"amount": 1}',
                headers=headers | {"Idempotency-Key": "cut-off"},
                timeout=15,
            )
        )
        if let_go == "timeout":
            answer = await write
            assert (answer.status, answer.reason) == (504, "upstream-timeout"), answer
        else:
            await asyncio.sleep(0.5)  # sent (the pooled connection), not answered
            assert not write.done()
            replica.signal(signal.SIGKILL if let_go == "kill" else signal.SIGSTOP)
        await asyncio.sleep(max(0.0, cut_at + CUT_SECONDS - time.monotonic()))
        namespace.heal()
        await asyncio.sleep(AFTER_HEAL_SECONDS)
        assert received_keys(received) == ["first"], (
            "a write the gateway let go of reached the upstream after the partition healed"
        )
        if let_go == "freeze":
            replica.signal(signal.SIGCONT)
            answer = await write
            assert answer.reason in ("upstream-timeout", "upstream-connection-lost"), answer
            await asyncio.sleep(1.0)
            assert received_keys(received) == ["first"]
        elif let_go == "kill":
            write.cancel()
