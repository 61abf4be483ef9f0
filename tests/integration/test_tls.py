"""TLS on the listeners, in-process: ``gateway.service.server.serve`` with certificates the test
makes (tests/certs.py). A handshake works and presents the configured certificate,
plain HTTP gets no answer, a reload presents the new certificate to new connections,
client certificates are required or optional as configured."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from gateway.config import ConfigError, Settings, load_settings
from gateway.service import tls
from gateway.service.server import serve
from tests.certs import Issued, Pki, peer_serial
from tests.support import Upstream


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[dict[str, str]]:
    """``serve`` in this process until the block ends; the listeners' addresses."""
    stop = asyncio.Event()
    ready: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(settings, stop=stop, announce=False, on_ready=ready.set_result)
    )
    try:
        done, _ = await asyncio.wait({task, ready}, timeout=30, return_when="FIRST_COMPLETED")
        if task in done:
            task.result()
        addresses = dict(a.split("=", 1) for a in ready.result())
        yield addresses
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def config(tmp_path: Path, tls_toml: str, extra: str = "") -> Settings:
    path = tmp_path / "fencegate.toml"
    path.write_text(
        'database_url = "sqlite+aiosqlite:///fencegate.db"\n'
        'proxy_listen = "127.0.0.1:0"\n'
        'control_listen = "127.0.0.1:0"\n'
        f"{extra}\n{tls_toml}\n",
        encoding="utf-8",
    )
    return load_settings(path, environ={})


async def handshake(address: str, context: ssl.SSLContext) -> tuple[int, str]:
    """TLS to ``address``, ``GET /healthz`` on it: the server certificate's serial
    number and the answer's status line."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status = (await asyncio.wait_for(reader.readline(), 10)).decode().strip()
        return peer_serial(der), status
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


async def plain_answer(address: str) -> bytes:
    """What a plain-HTTP request to ``address`` gets back (until the server closes)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            return await asyncio.wait_for(reader.read(), 10)
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def refused(address: str, context: ssl.SSLContext) -> bool:
    """The handshake fails, or the server closes without answering. (With TLS 1.3 the
    server's refusal of a client certificate reaches the client after its side of the
    handshake has ended, so it shows on the first read.)"""
    try:
        _, status = await handshake(address, context)
    except (ssl.SSLError, ConnectionError):
        return True
    return status == ""


def shared(server: Issued) -> str:
    return f'[tls]\ncert_file = "{server.cert}"\nkey_file = "{server.key}"\n'


async def test_both_listeners_speak_tls_and_refuse_plain_http(pki: Pki, tmp_path: Path) -> None:
    server = pki.issue("gateway", server=True)
    async with running(config(tmp_path, shared(server))) as addresses:
        for name in ("control", "proxy"):
            serial, status = await handshake(addresses[name], pki.client_context())
            assert serial == server.serial
            assert status.startswith("HTTP/1.1 "), status
            # The same port does not answer plain HTTP: no status line comes back.
            assert not (await plain_answer(addresses[name])).startswith(b"HTTP/")
        # A client that does not trust the CA does not get through.
        with pytest.raises(ssl.SSLCertVerificationError):
            await handshake(addresses["control"], ssl.create_default_context())
        async with aiohttp.ClientSession() as session:
            async with session.get(
                f"https://{addresses['control']}/healthz", ssl=pki.client_context()
            ) as resp:
                assert resp.status == 200
                assert await resp.json() == {"status": "ok"}


async def test_one_listener_with_tls_the_other_plain(pki: Pki, tmp_path: Path) -> None:
    server = pki.issue("proxy-only", server=True)
    settings = config(
        tmp_path, f'[tls.proxy]\ncert_file = "{server.cert}"\nkey_file = "{server.key}"\n'
    )
    async with running(settings) as addresses:
        serial, _ = await handshake(addresses["proxy"], pki.client_context())
        assert serial == server.serial
        assert (await plain_answer(addresses["control"])).startswith(b"HTTP/1.1 200")


async def test_proxied_request_over_tls_reaches_the_upstream(
    pki: Pki, tmp_path: Path, upstream: Upstream
) -> None:
    up = upstream
    up.status = 200
    server = pki.issue("gateway", server=True)
    settings = config(tmp_path, shared(server), f'[[upstreams]]\nname = "pay"\nurl = "{up.url}"\n')
    async with running(settings) as addresses, aiohttp.ClientSession() as session:
        async with session.get(
            f"https://{addresses['proxy']}/pay/v1/balance", ssl=pki.client_context()
        ) as resp:
            assert resp.status == 200, await resp.text()
    (seen,) = up.received
    assert seen["headers"]["X-Forwarded-Proto"] == "https"


async def test_reload_presents_the_new_certificate_to_new_connections(
    pki: Pki, tmp_path: Path
) -> None:
    first = pki.issue("first", server=True)
    second = pki.issue("second", server=True)
    settings = config(tmp_path, shared(first))
    live = tls.contexts(settings)
    assert set(live) == {"proxy", "control"}
    # Same files, new contents: the way cert-manager and most rotations work.
    first.cert.write_bytes(second.cert.read_bytes())
    first.key.write_bytes(second.key.read_bytes())
    assert tls.reload(live, settings) == ["proxy", "control"]
    # The running context itself changed (the listening socket keeps using it).
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=live["control"])
    async with server:
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=pki.client_context())
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        assert peer_serial(der) == second.serial


async def test_a_bad_certificate_on_reload_keeps_the_running_one(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = pki.issue("first", server=True)
    other = pki.issue("other", server=True)
    settings = config(tmp_path, shared(first))
    async with running(settings) as addresses:
        live_before, _ = await handshake(addresses["control"], pki.client_context())
        # A rotation caught half-way: the new certificate with the old key.
        first.cert.write_bytes(other.cert.read_bytes())
        contexts = tls.contexts(config(tmp_path, shared(pki.issue("x", server=True))))
        assert tls.reload(contexts, settings) == []
        assert "TLS reload refused" in caplog.text
        live_after, _ = await handshake(addresses["control"], pki.client_context())
        assert live_before == live_after == first.serial


async def test_required_client_certificates(pki: Pki, tmp_path: Path) -> None:
    server = pki.issue("gateway", server=True)
    client = pki.issue("worker-1", server=False)
    # Client certificates from another CA are refused as well.
    stranger = Pki(tmp_path / "other-pki", "Other CA").issue("intruder", server=False)
    settings = config(
        tmp_path,
        shared(server) + f'client_ca_file = "{pki.ca}"\n[tls.proxy]\nclient_certs = "required"\n',
    )
    async with running(settings) as addresses:
        _, status = await handshake(addresses["proxy"], pki.client_context(client))
        assert status.startswith("HTTP/1.1 ")
        assert await refused(addresses["proxy"], pki.client_context())
        assert await refused(addresses["proxy"], pki.client_context(stranger))
        # The control listener asks for none.
        _, status = await handshake(addresses["control"], pki.client_context())
        assert status.startswith("HTTP/1.1 200")


async def test_optional_client_certificates(pki: Pki, tmp_path: Path) -> None:
    server = pki.issue("gateway", server=True)
    client = pki.issue("worker-1", server=False)
    stranger = Pki(tmp_path / "other-pki", "Other CA").issue("intruder", server=False)
    settings = config(
        tmp_path, shared(server) + f'client_ca_file = "{pki.ca}"\nclient_certs = "optional"\n'
    )
    async with running(settings) as addresses:
        for context in (pki.client_context(client), pki.client_context()):
            _, status = await handshake(addresses["proxy"], context)
            assert status.startswith("HTTP/1.1 ")
        # A certificate that is sent must verify.
        assert await refused(addresses["proxy"], pki.client_context(stranger))


def test_tls_settings_are_checked(pki: Pki, tmp_path: Path) -> None:
    server = pki.issue("gateway", server=True)
    with pytest.raises(ConfigError, match=r"tls: .*cert_file and key_file go together"):
        config(tmp_path, f'[tls]\ncert_file = "{server.cert}"\n')
    with pytest.raises(ConfigError, match=r"tls: .*tls.proxy: client_certs = 'required' needs"):
        config(tmp_path, shared(server) + '[tls.proxy]\nclient_certs = "required"\n')
    with pytest.raises(ConfigError, match=r"tls.proxy.client_certs"):
        config(tmp_path, shared(server) + '[tls.proxy]\nclient_certs = "sometimes"\n')
    # Relative files are found next to the config file, as the SQLite database is.
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "c.pem").write_bytes(server.cert.read_bytes())
    (tmp_path / "certs" / "k.pem").write_bytes(server.key.read_bytes())
    settings = config(tmp_path, '[tls]\ncert_file = "certs/c.pem"\nkey_file = "certs/k.pem"\n')
    control = settings.tls.listener("control")
    assert control is not None and control.cert_file == tmp_path / "certs" / "c.pem"
    assert set(tls.contexts(settings)) == {"proxy", "control"}
    # A key that does not fit the certificate, a missing file: named, with the key.
    other = pki.issue("other", server=True)
    mismatched = config(tmp_path, f'[tls]\ncert_file = "{server.cert}"\nkey_file = "{other.key}"\n')
    with pytest.raises(ConfigError, match=r"tls.proxy: cannot load cert_file"):
        tls.contexts(mismatched)
    missing = config(tmp_path, '[tls]\ncert_file = "nope.pem"\nkey_file = "nope.key"\n')
    with pytest.raises(ConfigError, match=r"tls.proxy: .*nope.pem: no such file"):
        tls.contexts(missing)


async def test_serve_names_a_bad_certificate_before_binding(pki: Pki, tmp_path: Path) -> None:
    settings = config(tmp_path, '[tls]\ncert_file = "nope.pem"\nkey_file = "nope.key"\n')
    with pytest.raises(SystemExit, match=r"fencegate: invalid configuration:\n  tls.proxy"):
        await serve(settings, announce=False)
    assert not (tmp_path / "fencegate.db").exists()
