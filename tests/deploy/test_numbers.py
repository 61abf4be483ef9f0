"""The numbers of deploy/ agree with each other, with the configuration's defaults and
with what the docs say: the termination grace period covers the worst-case stop, the
Deployment's comments name the defaults, the replica counts of the Deployment, the HPA
and the docs agree, and the connections of every pod fit the documented PostgreSQL
``max_connections``."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

from gateway.config import GatewaySettings, Settings, load_settings
from gateway.service import tasks
from lease_core.db import create_engine

from ._support import COMPOSE, CONFIG, DEPLOY, KUBERNETES, ROOT, load_yaml_documents

OPERATIONS = ROOT / "docs" / "operations.md"
SCALING = ROOT / "docs" / "scaling.md"
README = DEPLOY / "README.md"
# Time left before SIGKILL beyond the computed worst case: the process's own start of
# the shutdown, the database's dispose, a busy node.
MARGIN_SECONDS = 5
# PostgreSQL's own: connections kept for superusers (superuser_reserved_connections).
SUPERUSER_RESERVED = 3
POSTGRES_DEFAULT_MAX_CONNECTIONS = 100


def kind(name: str) -> dict[str, Any]:
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in load_yaml_documents(path):
            if doc.get("kind") == name:
                return doc
    raise AssertionError(f"no {name} in deploy/kubernetes")


def deployed_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The configuration the pods run with: deploy/fencegate.toml and real tokens."""
    for variable in ("FENCEGATE_DATABASE_URL", "PAYMENTS_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FENCEGATE_AUTH__WORKER_TOKENS", '["worker-token-0123456789abcdef"]')
    monkeypatch.setenv("FENCEGATE_AUTH__ADMIN_TOKENS", '["admin-token-0123456789abcdef"]')
    return load_settings(CONFIG)


def pre_stop_seconds(container: dict[str, Any]) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


def worst_case_stop(gateway: GatewaySettings) -> float:
    """What ``fencegate serve`` may take after SIGTERM (docs/operations.md#signals):
    each listener drains for up to ``shutdown_timeout_seconds`` (the proxy's first, then
    the control's), then an upkeep step in progress gets ``tasks.STOP_TIMEOUT_SECONDS``.
    The longest request needs no term of its own: the drain cuts it off at the shutdown
    timeout (its outcome becomes unknown, as a SIGKILL would make it)."""
    return 2 * gateway.shutdown_timeout_seconds + tasks.STOP_TIMEOUT_SECONDS


def connections_per_process() -> int:
    """Up to ``pool_size`` on the hot path's asyncpg pool and as many on SQLAlchemy's
    (``lease_core.db.create_engine``: half as a pool, half as overflow)."""
    pool_size: int = inspect.signature(create_engine).parameters["pool_size"].default
    return 2 * pool_size


def test_grace_period_covers_the_worst_case_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    settings = deployed_settings(monkeypatch)
    needed = pre_stop_seconds(container) + worst_case_stop(settings.gateway) + MARGIN_SECONDS
    assert pod["terminationGracePeriodSeconds"] >= needed, (
        f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} < {needed}: "
        "preStop + 2 x shutdown_timeout_seconds + the upkeep's stop + margin"
    )


def test_the_docs_state_the_worst_case_stop_and_the_grace_period() -> None:
    text = " ".join(OPERATIONS.read_text(encoding="utf-8").split())
    defaults = GatewaySettings()
    assert f"`gateway.shutdown_timeout_seconds` ({defaults.shutdown_timeout_seconds:g} s)" in text
    match = re.search(
        r"In the worst case this takes twice `shutdown_timeout_seconds` plus (\d+) seconds "
        r"\((\d+) s with the defaults\)",
        text,
    )
    assert match, "operations.md#signals: the worst-case stop"
    assert int(match[1]) == tasks.STOP_TIMEOUT_SECONDS
    assert int(match[2]) == worst_case_stop(defaults)
    pod = kind("Deployment")["spec"]["template"]["spec"]
    match = re.search(r"The Kubernetes manifests allow (\d+) seconds", text)
    assert match and int(match[1]) == pod["terminationGracePeriodSeconds"]


def test_deployment_comments_name_the_defaults() -> None:
    text = (KUBERNETES / "deployment.yaml").read_text(encoding="utf-8")
    comments = " ".join(line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line)
    defaults = GatewaySettings()
    shutdown = defaults.shutdown_timeout_seconds
    match = re.search(r"in-flight requests then get up to (\d+) s", comments)
    assert match and float(match[1]) == shutdown, match and match[0]
    # Every "N s" in the grace period's comment is one of the terms it adds up.
    deployment = kind("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    match = re.search(r"The worst-case stop .*? plus margin", comments)
    assert match, "the grace period's comment"
    terms = {
        pre_stop_seconds(container),
        shutdown,
        float(tasks.STOP_TIMEOUT_SECONDS),
        pre_stop_seconds(container) + worst_case_stop(defaults),
    }
    stated = {float(n) for n in re.findall(r"(\d+) s\b", match[0])}
    assert stated and stated <= terms, (stated, terms)
    assert f"(in-flight requests then get up to {shutdown:g} s" in comments.replace("  ", " ")


def replica_counts() -> tuple[int, int, int]:
    deployment = kind("Deployment")
    hpa = kind("HorizontalPodAutoscaler")
    return deployment["spec"]["replicas"], hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]


def test_replica_counts_agree_with_the_hpa_and_the_docs() -> None:
    replicas, low, high = replica_counts()
    assert low <= replicas <= high
    # The HPA sets the count: the Deployment starts at the HPA's floor.
    assert replicas == low
    pdb = kind("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] < low
    readme = " ".join(README.read_text(encoding="utf-8").split())
    match = re.search(r"\*\*Deployment\*\* `fencegate`: (\d+) replicas", readme)
    assert match and int(match[1]) == replicas
    match = re.search(
        r"\*\*HorizontalPodAutoscaler\*\* \(`autoscaling/v2`\): (\d+)\u2013(\d+) replicas", readme
    )
    assert match and (int(match[1]), int(match[2])) == (low, high)
    hpa_text = (KUBERNETES / "hpa.yaml").read_text(encoding="utf-8")
    match = re.search(r"resets \.spec\.replicas to (\d+)", hpa_text)
    assert match and int(match[1]) == replicas


def documented_max_connections() -> int:
    readme = " ".join(README.read_text(encoding="utf-8").split())
    match = re.search(r"`max_connections = (\d+)`", readme)
    assert match, "deploy/README.md: the PostgreSQL max_connections the manifests need"
    return int(match[1])


def test_connections_at_the_hpa_maximum_fit_the_documented_max_connections() -> None:
    """At the HPA's maximum, during a rolling update (maxSurge more pods), with one
    `fencegate` command (the migration Job, or an operator's `fencegate audit`) open."""
    per_pod = connections_per_process()
    _, _, high = replica_counts()
    surge = kind("Deployment")["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert isinstance(surge, int), "give maxSurge as a number of pods"
    needed = (high + surge + 1) * per_pod + SUPERUSER_RESERVED
    assert needed <= documented_max_connections(), (
        f"({high} + {surge} + 1) x {per_pod} + {SUPERUSER_RESERVED} = {needed} connections"
    )
    readme = " ".join(README.read_text(encoding="utf-8").split())
    assert f"up to {per_pod} connections" in readme
    assert "PgBouncer" in readme and "max_prepared_statements" in readme
    for page in (OPERATIONS, SCALING):
        text = " ".join(page.read_text(encoding="utf-8").split())
        assert f"up to {per_pod} connections" in text, page.name


def test_compose_fits_postgresql_defaults() -> None:
    (doc,) = load_yaml_documents(COMPOSE)
    services = doc["services"]
    gateways = [name for name in services if name.startswith("gateway")]
    command = " ".join(services["postgres"].get("command", []))
    match = re.search(r"max_connections=(\d+)", command)
    limit = int(match[1]) if match else POSTGRES_DEFAULT_MAX_CONNECTIONS
    needed = (len(gateways) + 1) * connections_per_process() + SUPERUSER_RESERVED
    assert needed <= limit
