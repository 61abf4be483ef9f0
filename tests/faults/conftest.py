"""Fixtures of the fault suite: our own PostgreSQL cluster, a fresh database per test,
a process group that always ends what a test started, and the history of a test's
scripted writes.

``FENCEGATE_FAULTS_LONG=1`` selects the long local mode (more workers, jobs and time);
the default is the short CI mode. See README.md.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import IN_CI
from verify.cluster import ClusterError, PgCluster
from verify.worker import History

from .harness import ProcessGroup, migrate, scripted

LONG = os.environ.get("FENCEGATE_FAULTS_LONG", "").lower() not in ("", "0", "false")
TEMPLATE = "fg_template"


@pytest.fixture(scope="session")
def pg_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgCluster]:
    """A PostgreSQL cluster of our own (never the shared server), with a migrated
    template database. Fails in CI when it cannot start; skips elsewhere."""
    cluster = PgCluster()
    try:
        try:
            cluster.up()
            asyncio.run(cluster.execute(f'CREATE DATABASE "{TEMPLATE}"'))
            migrate(cluster.url(TEMPLATE), tmp_path_factory.mktemp("migrate"))
        except (ClusterError, OSError, AssertionError) as error:
            message = f"cannot run a PostgreSQL cluster of our own: {error}"
            if IN_CI:
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def fault_db(pg_cluster: PgCluster) -> Iterator[str]:
    """A fresh database (a copy of the migrated template) on our cluster; its URL."""
    pg_cluster.ensure_running()  # an earlier test may have failed with it stopped
    name = asyncio.run(pg_cluster.create_database(template=TEMPLATE))
    try:
        yield pg_cluster.url(name)
    finally:
        pg_cluster.ensure_running()
        asyncio.run(pg_cluster.drop_database(name))


@pytest.fixture
def group(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Processes the test starts; all killed (by pid) at the end, whatever happened."""
    processes = ProcessGroup(tmp_path)
    try:
        yield processes
    finally:
        processes.cleanup()


@pytest.fixture
def script(group: ProcessGroup) -> Iterator[History]:
    """The history of the test's scripted writes (``harness.raw_write``), beside its
    workers'; closed at the end."""
    history = scripted(group)
    try:
        yield history
    finally:
        history.writer.close()
