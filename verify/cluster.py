"""A throw-away PostgreSQL cluster of our own, for faults that take the database away
(``python -m verify`` and the fault suite, ``tests/faults``).

The shared server on 127.0.0.1:5432 is other people's: nothing here restarts or stops it.
Here ``initdb`` makes a cluster in a temporary folder, listening on 127.0.0.1 (and the
extra addresses given, such as the root side of ``verify.netns`` namespaces, whose
10.213.0.0/16 clients it trusts) and a free port with its Unix socket in that folder,
``fsync = off`` for speed. As root the binaries run as the ``postgres`` OS user
(``initdb`` refuses root).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

PG_BIN = Path(os.environ.get("FENCEGATE_FAULTS_PG_BIN", "/usr/lib/postgresql/15/bin"))
OS_USER = "postgres"
TRUSTED_SUBNET = "10.213.0.0/16"  # verify.netns: the namespaces' side of their veth pairs


async def execute(url: str, sql: str) -> list[sa.Row[Any]]:
    """One statement outside a transaction (CREATE DATABASE, ALTER SYSTEM) at ``url``."""
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            result = await conn.execute(sa.text(sql))
            return list(result.all()) if result.returns_rows else []
    finally:
        await engine.dispose()


class ClusterError(Exception):
    """The cluster could not be made or started."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class PgCluster:
    """``initdb`` + ``pg_ctl`` on a temporary folder. Blocking methods: call them from a
    thread (``asyncio.to_thread``) when workers are running in the event loop."""

    def __init__(self, listen: Sequence[str] = ()) -> None:
        """``listen``: addresses to listen on besides 127.0.0.1 (they must exist)."""
        self.listen = ["127.0.0.1", *(a for a in listen if a != "127.0.0.1")]
        self.base = Path(tempfile.mkdtemp(prefix="fencegate-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "postgres.log"
        self.port = 0
        self.as_root = os.geteuid() == 0

    # -- running the binaries -------------------------------------------------------

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        command = [str(PG_BIN / args[0]), *args[1:]]
        if self.as_root:
            command = ["runuser", "-u", OS_USER, "--", *command]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, cwd=self.base
        )
        if result.returncode != 0:
            raise ClusterError(
                f"{' '.join(args[:2])} exited with {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}\n{self.server_log()[-3000:]}"
            )
        return result

    def server_log(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def init(self) -> None:
        if not (PG_BIN / "initdb").is_file():
            raise ClusterError(f"no initdb in {PG_BIN} (set FENCEGATE_FAULTS_PG_BIN)")
        if self.as_root:
            if shutil.which("runuser") is None:
                raise ClusterError("running as root, but runuser is missing")
            shutil.chown(self.base, user=OS_USER)
        self._run(
            "initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
            "--no-sync", "--no-instructions",
        )  # fmt: skip

    def configure(self, port: int) -> None:
        self.port = port
        settings = {
            "listen_addresses": "'" + ",".join(self.listen) + "'",
            "port": str(port),
            "unix_socket_directories": f"'{self.base}'",
            "fsync": "off",
            "full_page_writes": "off",
            "max_connections": "300",
            "shared_buffers": "32MB",
            "log_min_messages": "warning",
            "log_line_prefix": "'%m [%p] '",
        }
        conf = self.data / "postgresql.conf"
        original = self.data / "postgresql.conf.initdb"
        if not original.exists():
            shutil.copy(conf, original)
            if self.as_root:  # the server reads its folder whole (pg_basebackup)
                shutil.chown(original, user=OS_USER)
        ours = "".join(f"{name} = {value}\n" for name, value in settings.items())
        conf.write_text(original.read_text() + "\n# fencegate fault tests\n" + ours)
        hba = self.data / "pg_hba.conf"
        trust = f"host all all {TRUSTED_SUBNET} trust\n"
        if len(self.listen) > 1 and trust not in hba.read_text():
            hba.write_text(hba.read_text() + trust)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m fast|immediate`` (immediate: no checkpoint, crash recovery
        at start)."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"restart mode {mode!r}: smart, fast or immediate")
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", mode, "-w", "-t", "60",
            "restart",
        )  # fmt: skip

    def is_running(self) -> bool:
        command = [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "status"]
        if self.as_root:
            command = ["runuser", "-u", OS_USER, "--", *command]
        return subprocess.run(command, capture_output=True, check=False).returncode == 0

    def ensure_running(self) -> None:
        if not self.is_running():
            self.start()

    def up(self) -> None:
        """initdb, configure and start on a free port (a few tries: ports can be taken)."""
        self.init()
        last: Exception | None = None
        for _ in range(3):
            self.configure(free_port())
            try:
                self.start()
                return
            except ClusterError as error:
                last = error
        raise ClusterError(f"the cluster did not start: {last}")

    def standby(self) -> PgCluster:
        """A streaming standby of this cluster (``pg_basebackup -R``), started on a port
        of its own. It replicates asynchronously unless this cluster names it in
        ``synchronous_standby_names`` (``'*'`` names any)."""
        standby = PgCluster(listen=self.listen[1:])
        if standby.as_root:
            shutil.chown(standby.base, user=OS_USER)
        standby._run(
            "pg_basebackup", "-D", str(standby.data), "-R", "-X", "stream",
            "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "--no-sync",
            "--checkpoint=fast",
        )  # fmt: skip
        standby.configure(free_port())
        standby.start()
        return standby

    def promote(self) -> None:
        """A standby becomes a primary (``pg_ctl promote``; waits until it takes writes)."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def destroy(self) -> None:
        try:
            if self.data.exists() and self.is_running():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    # -- databases ---------------------------------------------------------------------

    def url(self, database: str = "postgres", host: str = "127.0.0.1") -> str:
        return f"postgresql+asyncpg://postgres@{host}:{self.port}/{database}"

    async def execute(self, sql: str, database: str = "postgres") -> list[sa.Row[Any]]:
        return await execute(self.url(database), sql)

    async def create_database(self, template: str | None = None) -> str:
        name = f"fg_{uuid.uuid4().hex[:12]}"
        suffix = f' TEMPLATE "{template}"' if template else ""
        await self.execute(f'CREATE DATABASE "{name}"{suffix}')
        return name

    async def drop_database(self, name: str) -> None:
        await self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    # -- holding commits ----------------------------------------------------------------

    async def hold_commits(self) -> None:
        """From now on every commit that wrote waits for a synchronous standby that does
        not exist: the transaction is durable locally but its COMMIT is not answered (and
        it is not visible) until ``release_commits``."""
        await self.execute("ALTER SYSTEM SET synchronous_standby_names = 'fencegate_nobody'")
        await self.execute("SELECT pg_reload_conf()")

    async def release_commits(self) -> None:
        """Answer the held commits: they become visible at once."""
        await self.execute("ALTER SYSTEM RESET synchronous_standby_names")
        await self.execute("SELECT pg_reload_conf()")

    async def held_commits(self, database: str) -> int:
        rows = await self.execute(
            "SELECT count(*) FROM pg_stat_activity "
            f"WHERE wait_event = 'SyncRep' AND datname = '{database}'"
        )
        return int(rows[0][0])

    async def lock_waits(self, database: str) -> int:
        """Sessions of ``database`` waiting for a lock."""
        rows = await self.execute(
            "SELECT count(*) FROM pg_stat_activity "
            f"WHERE wait_event_type = 'Lock' AND datname = '{database}'"
        )
        return int(rows[0][0])

    async def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.execute("SELECT 1")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
