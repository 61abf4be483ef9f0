"""``fencegate serve`` with TLS, as a process: both listeners speak TLS with the
configured certificate, plain HTTP gets no answer, a worker without a client certificate
is refused where they are required, and SIGHUP makes new connections see a new
certificate while the process keeps running."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from tests.certs import Pki
from tests.integration.test_tls import handshake, plain_answer, refused

from .test_serve_processes import FENCEGATE, LISTENING, _popen, _read, write_config


@pytest.mark.timeout(90)
async def test_serve_with_tls_mtls_and_a_reload(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    first = pki.issue("gateway", server=True)
    second = pki.issue("gateway-next", server=True)
    worker = pki.issue("worker-1", server=False)
    config = write_config(
        tmp_path / "conf",
        "sqlite+aiosqlite:///data.db",
        # Files relative to the config file; a worker certificate required on the proxy.
        f'[tls]\ncert_file = "../pki/gateway.crt"\nkey_file = "../pki/gateway.key"\n'
        f'client_ca_file = "{pki.ca}"\n'
        '[tls.proxy]\nclient_certs = "required"\n',
    )
    log = config.parent / "server.log"
    with _popen([FENCEGATE, "serve", "--config", str(config)], tmp_path, log) as process:
        deadline = time.monotonic() + 30
        match = None
        while match is None:
            if process.poll() is not None:
                pytest.fail(f"fencegate serve exited with {process.returncode}:\n{_read(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"fencegate serve did not start:\n{_read(log)}")
            await asyncio.sleep(0.05)
            match = LISTENING.search(_read(log))
        control, proxy = match[1], match[2]

        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://{control}/readyz", ssl=pki.client_context()) as resp:
                assert resp.status == 200, await resp.text()
        serial, status = await handshake(control, pki.client_context())
        assert (serial, status) == (first.serial, "HTTP/1.1 200 OK")
        assert not (await plain_answer(control)).startswith(b"HTTP/")
        assert not (await plain_answer(proxy)).startswith(b"HTTP/")
        # The proxy: a worker with a certificate of the CA gets an answer, one without
        # is refused in the handshake.
        serial, status = await handshake(proxy, pki.client_context(worker))
        assert serial == first.serial and status.startswith("HTTP/1.1 ")
        assert await refused(proxy, pki.client_context())

        # Rotate the files in place and send SIGHUP: new connections see the new one.
        first.cert.write_bytes(second.cert.read_bytes())
        first.key.write_bytes(second.key.read_bytes())
        process.send_signal(signal.SIGHUP)
        while (await handshake(control, pki.client_context()))[0] != second.serial:
            if time.monotonic() > deadline + 30:
                pytest.fail(f"the new certificate was never served:\n{_read(log)}")
            await asyncio.sleep(0.05)
        serial, status = await handshake(proxy, pki.client_context(worker))
        assert serial == second.serial and status.startswith("HTTP/1.1 ")
        assert "TLS certificates reloaded: proxy, control" in _read(log)
        assert process.poll() is None

        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 20) == 0, _read(log)
