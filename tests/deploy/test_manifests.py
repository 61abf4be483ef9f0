"""Static checks of deploy/: the Kubernetes manifests against the Kubernetes schemas
(offline, with kubernetes-validate) and against each other, the compose file, the
Dockerfile and the example configuration."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import sqlalchemy as sa
import yaml

from gateway.config import ConfigError, load_settings, resolve_secrets

from ._support import (
    COMPOSE,
    CONFIG,
    CONFIG_IN_IMAGE,
    DEPLOY,
    KUBERNETES,
    ROOT,
    copy_sources,
    dockerfile,
    dockerignore_patterns,
    env_refs,
    exec_form,
    healthcheck_command,
    ignored,
    kubernetes_files,
    kubernetes_manifests,
    load_yaml_documents,
)

# The oldest Kubernetes minor these manifests promise to work on (its schemas ship with
# kubernetes-validate, so the check runs offline).
KUBERNETES_VERSION = "1.30"
GATEWAY_SECRETS = {
    "FENCEGATE_DATABASE_URL",
    "FENCEGATE_AUTH__WORKER_TOKENS",
    "FENCEGATE_AUTH__ADMIN_TOKENS",
}
WORKER_LABEL = ("app.kubernetes.io/role", "worker")
UID = 10001

MANIFESTS = kubernetes_manifests()
# Custom resources: their schemas are not among the Kubernetes ones, so they are checked
# structurally (below); each is an optional file, outside kustomization.yaml's
# resources, since applying it fails on a cluster without its CRD.
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "Cluster": "postgresql.cnpg.io/v1"}
OPTIONAL_FILES = {"servicemonitor.yaml", "cnpg-cluster.yaml"}
BUILT_IN = [m for m in MANIFESTS if m[1]["kind"] not in CUSTOM_KINDS]


def _id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def one(kind: str) -> dict[str, Any]:
    docs = of_kind(kind)
    assert len(docs) == 1, f"expected one {kind}, found {len(docs)}"
    return docs[0]


def named(kind: str, name: str) -> dict[str, Any]:
    docs = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    assert docs, f"no {kind} named {name}"
    return docs[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def match_labels(selector: dict[str, Any]) -> dict[str, str]:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is checked here: {selector}"
    labels: dict[str, str] = selector["matchLabels"]
    return labels


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    found: dict[str, Any] = containers[0]
    return found


def port_number(workload: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    for item in container(workload)["ports"]:
        if item["name"] == port:
            number: int = item["containerPort"]
            return number
    raise AssertionError(f"no container port named {port}")


# -- schema validation -----------------------------------------------------------------


def test_manifests_found() -> None:
    kinds = sorted(doc["kind"] for _, doc in MANIFESTS)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Secret",
            "Secret",
            "Job",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "NetworkPolicy",
            "ServiceMonitor",
            "Cluster",
        ]
    )


@pytest.mark.parametrize("item", BUILT_IN, ids=[_id(m) for m in BUILT_IN])
def test_manifest_matches_kubernetes_schema(item: tuple[Path, dict[str, Any]]) -> None:
    _, doc = item
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(p) for p in error.path)
        pytest.fail(f"{_id(item)}: {path}: {error.message}", pytrace=False)


def test_schema_validation_is_strict() -> None:
    """The validator really rejects a misspelt field and a wrong type (so the test above
    cannot pass vacuously)."""
    deployment = copy.deepcopy(one("Deployment"))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = copy.deepcopy(one("Deployment"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_manifests_are_namespace_less_and_labelled() -> None:
    names = set()
    for path, doc in MANIFESTS:
        meta = doc["metadata"]
        assert "namespace" not in meta, f"{path.name}: set the namespace with kustomize"
        assert meta["labels"]["app.kubernetes.io/name"] == "fencegate", path.name
        names.add((doc["kind"], meta["name"]))
    assert len(names) == len(MANIFESTS), "two manifests share a kind and a name"


# -- the workloads ---------------------------------------------------------------------


def test_deployment_runs_several_hardened_replicas() -> None:
    deployment = one("Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    assert selects(match_labels(spec["selector"]), pod_labels(deployment))
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == UID
    assert pod["automountServiceAccountToken"] is False
    # A Service named `fencegate` would otherwise inject FENCEGATE_SERVICE_HOST etc.,
    # which share the prefix of the program's settings.
    assert pod["enableServiceLinks"] is False
    main = container(deployment)
    assert main["args"] == ["serve", "--config", CONFIG_IN_IMAGE]
    security = main["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    resources = main["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])  # the HPA needs a CPU request
    assert "memory" in resources["limits"]
    assert {p["name"]: p["containerPort"] for p in main["ports"]} == {
        "proxy": 8080,
        "control": 8081,
    }


def test_deployment_spreads_its_replicas() -> None:
    deployment = one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    constraints = pod.get("topologySpreadConstraints", [])
    anti = pod.get("affinity", {}).get("podAntiAffinity")
    assert constraints or anti
    for constraint in constraints:
        assert selects(match_labels(constraint["labelSelector"]), pod_labels(deployment))
    assert any(c["topologyKey"] == "kubernetes.io/hostname" for c in constraints) or anti


def test_probes_use_health_endpoints_on_the_control_port() -> None:
    deployment = one("Deployment")
    main = container(deployment)
    liveness = main["livenessProbe"]["httpGet"]
    readiness = main["readinessProbe"]["httpGet"]
    assert liveness["path"] == "/healthz"
    assert readiness["path"] == "/readyz"
    assert port_number(deployment, liveness["port"]) == 8081
    assert port_number(deployment, readiness["port"]) == 8081
    if "startupProbe" in main:
        startup = main["startupProbe"]["httpGet"]
        assert startup["path"] == "/healthz"
        assert port_number(deployment, startup["port"]) == 8081


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_tmp_is_writable_and_config_is_mounted(kind: str) -> None:
    workload = one(kind)
    pod = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container(workload)["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    config_dir = str(Path(CONFIG_IN_IMAGE).parent)
    config_volume = volumes[mounts[config_dir]["name"]]
    config_map = named("ConfigMap", config_volume["configMap"]["name"])
    assert Path(CONFIG_IN_IMAGE).name in config_map["data"]
    assert mounts[config_dir].get("readOnly") is True


def test_migration_job_runs_migrate() -> None:
    job = one("Job")
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1
    assert spec["ttlSecondsAfterFinished"] > 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container(job)["securityContext"]["readOnlyRootFilesystem"] is True
    args = container(job).get("command", []) + container(job)["args"]
    assert args == ["migrate", "--config", CONFIG_IN_IMAGE]
    # Same image, configuration and database URL as the gateways: it migrates their
    # database. Nothing else of their Secret (tokens, the upstreams' keys) reaches it.
    deployment = one("Deployment")
    assert container(job)["image"] == container(deployment)["image"]
    assert "envFrom" not in container(job)
    [env] = container(job)["env"]
    assert env["name"] == "FENCEGATE_DATABASE_URL"
    [source] = container(deployment)["envFrom"]
    assert env["valueFrom"]["secretKeyRef"] == {
        "name": source["secretRef"]["name"],
        "key": "FENCEGATE_DATABASE_URL",
    }
    # The Job's pods are not gateway pods: no Service traffic, not in the PDB.
    assert not selects(one("Service")["spec"]["selector"], pod_labels(job))
    assert not selects(
        match_labels(one("PodDisruptionBudget")["spec"]["selector"]), pod_labels(job)
    )


# -- how the objects refer to each other -----------------------------------------------


def test_service_selects_the_gateway_pods() -> None:
    service = one("Service")
    deployment = one("Deployment")
    assert selects(service["spec"]["selector"], pod_labels(deployment))
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"proxy", "control"}
    assert ports["proxy"]["port"] == 8080
    assert ports["control"]["port"] == 8081
    assert port_number(deployment, ports["proxy"]["targetPort"]) == 8080
    assert port_number(deployment, ports["control"]["targetPort"]) == 8081


def test_pdb_and_hpa_target_the_deployment() -> None:
    deployment = one("Deployment")
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    assert selects(match_labels(pdb["spec"]["selector"]), pod_labels(deployment))
    hpa = one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1",
        "Deployment",
        deployment["metadata"]["name"],
    )
    assert hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    metrics = hpa["spec"]["metrics"]
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in metrics)


def test_every_referenced_configmap_and_secret_exists() -> None:
    secrets = {d["metadata"]["name"]: d for d in of_kind("Secret")}
    config_maps = {d["metadata"]["name"]: d for d in of_kind("ConfigMap")}
    referenced = 0
    for kind in ("Deployment", "Job"):
        workload = one(kind)
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
                referenced += 1
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
                referenced += 1
        for item in pod["containers"] + pod.get("initContainers", []):
            for source in item.get("envFrom", []):
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps
                referenced += 1
            for env in item.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    secret = secrets[ref["secretKeyRef"]["name"]]
                    assert ref["secretKeyRef"]["key"] in secret["stringData"]
                    referenced += 1
                if "configMapKeyRef" in ref:
                    config_map = config_maps[ref["configMapKeyRef"]["name"]]
                    assert ref["configMapKeyRef"]["key"] in config_map["data"]
    assert referenced >= 4


def test_secret_provides_every_variable_the_config_needs() -> None:
    secret = named("Secret", "fencegate-secrets")
    keys = set(secret["stringData"])
    assert keys >= GATEWAY_SECRETS | env_refs(CONFIG.read_text(encoding="utf-8"))
    # Each key must be a valid environment variable name, since it arrives by envFrom.
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in keys)


def test_secret_placeholders_are_refused_until_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Applying the example Secret unchanged must not give a running gateway with known
    tokens: its placeholders fail validation. Replaced by real tokens, the same
    configuration (the ConfigMap's) is valid and takes the Secret's values."""
    placeholders = dict(named("Secret", "fencegate-secrets")["stringData"])
    config = tmp_path / "fencegate.toml"
    config.write_text(one("ConfigMap")["data"]["fencegate.toml"], encoding="utf-8")
    for key, value in placeholders.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    problems = [p for p in error.value.problems if p.startswith("auth.")]
    assert len(problems) == 2, error.value.problems  # worker and admin tokens

    monkeypatch.setenv("FENCEGATE_AUTH__WORKER_TOKENS", '["worker-token-0123456789abcdef"]')
    monkeypatch.setenv("FENCEGATE_AUTH__ADMIN_TOKENS", '["admin-token-0123456789abcdef"]')
    settings = resolve_secrets(load_settings(config))
    assert settings.database_url == placeholders["FENCEGATE_DATABASE_URL"]
    assert len(settings.auth.worker_tokens) == len(settings.auth.admin_tokens) == 1
    (payments,) = settings.upstreams
    authorization = payments.set_headers["Authorization"].get_secret_value()
    assert authorization == f"Bearer {placeholders['PAYMENTS_API_KEY']}"


def test_configmap_is_the_example_config() -> None:
    config_map = one("ConfigMap")
    assert config_map["data"] == {"fencegate.toml": CONFIG.read_text(encoding="utf-8")}


def test_network_policies() -> None:
    policies = of_kind("NetworkPolicy")
    deployment_pods = pod_labels(one("Deployment"))
    job_pods = pod_labels(one("Job"))

    gateway = [
        p for p in policies if selects(match_labels(p["spec"]["podSelector"]), deployment_pods)
    ]
    assert len(gateway) == 1
    spec = gateway[0]["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    # The migration Job is covered too, so it may reach the database.
    assert selects(match_labels(spec["podSelector"]), job_pods)
    worker_ports: set[int] = set()
    for rule in spec["ingress"]:
        for peer in rule["from"]:
            if peer.get("podSelector", {}).get("matchLabels") == dict([WORKER_LABEL]):
                worker_ports |= {p["port"] for p in rule["ports"]}
    # Workers reach the proxy (and the lease API on the control port), nothing else.
    assert 8080 in worker_ports
    assert worker_ports <= {8080, 8081}
    egress_ports = {p["port"] for rule in spec["egress"] for p in rule.get("ports", [])}
    assert {5432, 53} <= egress_ports
    assert 443 in egress_ports  # the HTTPS upstreams
    assert all(rule.get("ports") for rule in spec["egress"]), "egress limited by port"

    workers = [
        p for p in policies if p["spec"]["podSelector"] == {"matchLabels": dict([WORKER_LABEL])}
    ]
    assert len(workers) == 1
    assert workers[0]["spec"]["policyTypes"] == ["Egress"]
    for rule in workers[0]["spec"]["egress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports == {53}:
            continue  # DNS
        assert ports <= {8080, 8081}
        assert all(
            selects(match_labels(peer["podSelector"]), deployment_pods) for peer in rule["to"]
        )


# -- the ServiceMonitor (Prometheus Operator) -----------------------------------------


def test_custom_resources_are_optional_files() -> None:
    for path, doc in MANIFESTS:
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] == CUSTOM_KINDS[doc["kind"]], path.name
            assert path.name in OPTIONAL_FILES, f"{path.name}: keep CRD kinds optional"


def test_servicemonitor_scrapes_every_replica_with_the_scrape_token() -> None:
    """The CRD's schema is not in kubernetes-validate: its shape is checked here, and
    what it refers to: the Service (by labels and port name), the path, the Secret and
    key of the bearer token, and that the Deployment hands the same key to the gateway
    as auth.metrics_tokens."""
    monitor = one("ServiceMonitor")
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["metadata"]) <= {"name", "labels", "annotations"}
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    service = one("Service")
    assert selects(match_labels(spec["selector"]), service["metadata"]["labels"])
    (endpoint,) = spec["endpoints"]
    allowed = {"port", "path", "scheme", "interval", "scrapeTimeout", "authorization"}
    assert set(endpoint) <= allowed, set(endpoint) - allowed
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    deployment = one("Deployment")
    assert port_number(deployment, ports[endpoint["port"]]["targetPort"]) == 8081
    assert endpoint["path"] == "/metrics"
    assert endpoint["scheme"] in ("http", "https")
    for key in ("interval", "scrapeTimeout"):
        assert re.fullmatch(r"\d+(ms|s|m)", endpoint[key]), (key, endpoint[key])
    authorization = endpoint["authorization"]
    assert authorization["type"] == "Bearer"
    assert set(authorization["credentials"]) == {"name", "key"}
    secret = named("Secret", authorization["credentials"]["name"])
    assert authorization["credentials"]["key"] in secret["stringData"]
    # Not the gateway's Secret: Prometheus may be allowed to read this one alone.
    assert secret["metadata"]["name"] != "fencegate-secrets"
    env = {e["name"]: e for e in container(deployment)["env"]}
    source = env["METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (source["name"], source["key"]) == (
        secret["metadata"]["name"],
        authorization["credentials"]["key"],
    )
    names = list(env)
    assert names.index("METRICS_TOKEN") < names.index("FENCEGATE_AUTH__METRICS_TOKENS")
    assert env["FENCEGATE_AUTH__METRICS_TOKENS"]["value"] == '["$(METRICS_TOKEN)"]'


def test_scrape_token_placeholder_is_refused_until_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "fencegate.toml"
    config.write_text(one("ConfigMap")["data"]["fencegate.toml"], encoding="utf-8")
    for key, value in named("Secret", "fencegate-secrets")["stringData"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FENCEGATE_AUTH__WORKER_TOKENS", '["worker-token-0123456789abcdef"]')
    monkeypatch.setenv("FENCEGATE_AUTH__ADMIN_TOKENS", '["admin-token-0123456789abcdef"]')
    env = {e["name"]: e for e in container(one("Deployment"))["env"]}
    template = env["FENCEGATE_AUTH__METRICS_TOKENS"]["value"]
    placeholder = named("Secret", "fencegate-metrics")["stringData"]["token"]
    monkeypatch.setenv(
        "FENCEGATE_AUTH__METRICS_TOKENS", template.replace("$(METRICS_TOKEN)", placeholder)
    )
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    assert [p.split(":")[0] for p in error.value.problems] == ["auth.metrics_tokens"]
    real = "0123456789abcdef0123456789abcdef"
    monkeypatch.setenv("FENCEGATE_AUTH__METRICS_TOKENS", template.replace("$(METRICS_TOKEN)", real))
    settings = load_settings(config)
    assert [t.get_secret_value() for t in settings.auth.metrics_tokens] == [real]


# -- kustomize -------------------------------------------------------------------------


def kustomization() -> dict[str, Any]:
    (doc,) = load_yaml_documents(KUBERNETES / "kustomization.yaml")
    return doc


def test_kustomization_lists_every_manifest() -> None:
    resources = kustomization()["resources"]
    assert len(resources) == len(set(resources))
    assert sorted(resources) == [p.name for p in kubernetes_files() if p.name not in OPTIONAL_FILES]


def test_kustomization_sets_the_image_of_the_workloads() -> None:
    images = {i["name"]: i for i in kustomization().get("images", [])}
    for kind in ("Deployment", "Job"):
        name = container(one(kind))["image"].split(":")[0]
        assert name in images


def test_kustomize_builds() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the kustomization is still checked above)")
    result = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == sorted(
        (d["kind"], d["metadata"]["name"]) for p, d in MANIFESTS if p.name not in OPTIONAL_FILES
    )
    for doc in built:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


# -- compose ---------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    (doc,) = load_yaml_documents(COMPOSE)
    return doc


def depends(service: dict[str, Any]) -> dict[str, str]:
    found = service.get("depends_on", {})
    assert isinstance(found, dict), "use the long depends_on form with conditions"
    return {name: spec["condition"] for name, spec in found.items()}


def test_compose_postgres_is_healthchecked_with_a_volume() -> None:
    doc = compose()
    postgres = doc["services"]["postgres"]
    assert postgres["image"].startswith("postgres:15")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    volume = postgres["volumes"][0].split(":")
    assert volume[1] == "/var/lib/postgresql/data"
    assert volume[0] in doc["volumes"]


def test_compose_migrates_before_the_gateways() -> None:
    services = compose()["services"]
    migrate = services["migrate"]
    assert migrate["command"][0] == "migrate"
    assert depends(migrate) == {"postgres": "service_healthy"}
    assert migrate.get("restart", "no") == "no"
    gateways = {name: s for name, s in services.items() if name.startswith("gateway")}
    assert sorted(gateways) == ["gateway-1", "gateway-2"]
    published: list[str] = []
    for name, gateway in gateways.items():
        assert gateway["command"][:1] == ["serve"], name
        assert depends(gateway)["migrate"] == "service_completed_successfully", name
        assert gateway["image"] == migrate["image"]
        test = " ".join(gateway["healthcheck"]["test"])
        assert "http://127.0.0.1:8081/healthz" in test, name
        assert "curl" not in test and "wget" not in test, "the slim image has neither"
        hosts = [p.rsplit(":", 1)[0] for p in gateway["ports"]]
        targets = sorted(int(p.rsplit(":", 1)[1]) for p in gateway["ports"])
        assert targets == [8080, 8081], name
        published += hosts
    assert len(published) == len(set(published)), "the replicas publish different ports"


def test_compose_gateways_get_config_and_secrets() -> None:
    services = compose()["services"]
    for name in ("migrate", "gateway-1", "gateway-2"):
        service = services[name]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert (COMPOSE.parent / mounts[CONFIG_IN_IMAGE]).resolve() == CONFIG
        assert service["command"][1:] == ["--config", CONFIG_IN_IMAGE]
        env = service["environment"]
        if name == "migrate":  # the database URL alone: no token, no upstream key
            assert set(env) == {"FENCEGATE_DATABASE_URL"}
        else:
            assert set(env) >= GATEWAY_SECRETS | env_refs(CONFIG.read_text(encoding="utf-8"))
        assert env["FENCEGATE_DATABASE_URL"].startswith("postgresql+asyncpg://")
        assert "@postgres:5432/" in env["FENCEGATE_DATABASE_URL"]
        build = service["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == (
            DEPLOY / "Dockerfile"
        )


def test_compose_variables_are_documented() -> None:
    used = env_refs(COMPOSE.read_text(encoding="utf-8"))
    example = (DEPLOY / "compose.env.example").read_text(encoding="utf-8")
    documented = {
        line.split("=", 1)[0] for line in example.splitlines() if re.match(r"[A-Z_]+=", line)
    }
    assert used == documented
    # Shipped empty, so nobody runs with example secrets by accident.
    assert all(line.endswith("=") for line in example.splitlines() if re.match(r"[A-Z_]+=", line))
    assert ".env" in (DEPLOY / ".gitignore").read_text(encoding="utf-8").split()


# -- Dockerfile ------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_on_python_slim() -> None:
    instructions = dockerfile()
    args = {}
    for item in instructions:
        if item.keyword == "ARG" and item.stage == -1 and "=" in item.value:
            key, _, value = item.value.partition("=")
            args[key] = value
    froms = [i.value for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2
    for value in froms:
        image = value.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert image == "python:3.11-slim"
    runs = " ".join(i.value for i in instructions if i.keyword == "RUN")
    assert "pip wheel --no-deps" in runs
    final = len(froms) - 1
    final_runs = " ".join(i.value for i in instructions if i.keyword == "RUN" and i.stage == final)
    assert "[postgres,otel]" in final_runs  # the drivers and tracing ([tracing])


def test_dockerfile_runs_as_non_root_and_serves() -> None:
    instructions = dockerfile()
    final = max(i.stage for i in instructions)
    users = [i.value for i in instructions if i.keyword == "USER" and i.stage == final]
    assert users, "no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert user == str(UID)  # the Kubernetes securityContext uses the same number
    workdirs = [i.value for i in instructions if i.keyword == "WORKDIR" and i.stage == final]
    assert workdirs
    exposed = {p for i in instructions if i.keyword == "EXPOSE" for p in i.value.split()}
    assert exposed == {"8080", "8081"}
    (entrypoint,) = [i.value for i in instructions if i.keyword == "ENTRYPOINT"]
    assert exec_form(entrypoint) == ["fencegate"]
    cmd = [i.value for i in instructions if i.keyword == "CMD"][-1]
    assert exec_form(cmd) == ["serve", "--config", CONFIG_IN_IMAGE]


def test_dockerfile_healthcheck_uses_python() -> None:
    command = healthcheck_command(dockerfile())
    assert command[0] == "python"
    joined = " ".join(command)
    assert "urllib" in joined
    assert "http://127.0.0.1:8081/healthz" in joined


def test_dockerfile_copies_only_what_the_context_has() -> None:
    """Every COPY source exists and is not left out of the build context by either
    .dockerignore (the root one, and BuildKit's deploy/Dockerfile.dockerignore)."""
    root_ignore = dockerignore_patterns(ROOT / ".dockerignore")
    buildkit_ignore = dockerignore_patterns(DEPLOY / "Dockerfile.dockerignore")
    assert root_ignore == buildkit_ignore
    sources = copy_sources(dockerfile())
    needed = {"pyproject.toml", "gateway/", "lease_core/", "client/", "alembic/"}
    assert needed <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored(source, root_ignore), f"{source} is excluded by .dockerignore"
    for local in (
        ".venv", ".git", "build", "gateway/__pycache__", "fencegate.db", "deploy/.env",
        "client/fencegate_client.egg-info",
    ):  # fmt: skip
        assert ignored(local, root_ignore), f"{local} would be sent to the build context"


def test_example_config_is_the_image_default() -> None:
    instructions = dockerfile()
    copies = [i.value.split() for i in instructions if i.keyword == "COPY"]
    assert ["deploy/fencegate.toml", CONFIG_IN_IMAGE] in copies
    data = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
    assert data["proxy_listen"] == "0.0.0.0:8080"
    assert data["control_listen"] == "0.0.0.0:8081"
    assert data["auth"] == {"worker_tokens": [], "admin_tokens": []}  # from the Secret
    (payments,) = data["upstreams"]
    assert "${PAYMENTS_API_KEY}" in payments["set_headers"]["Authorization"]


# -- the CloudNativePG Cluster -------------------------------------------------------------


def test_cnpg_cluster_replicates_synchronously_to_every_standby() -> None:
    """The operator's CRD is not in kubernetes-validate: the fields that matter are
    checked here. Every standby synchronous (maxSyncReplicas = instances - 1), at least
    one always (minSyncReplicas >= 1): serve refuses an asynchronous standby."""
    cluster = one("Cluster")
    assert set(cluster) == {"apiVersion", "kind", "metadata", "spec"}
    spec = cluster["spec"]
    allowed = {
        "instances", "imageName", "primaryUpdateStrategy", "minSyncReplicas",
        "maxSyncReplicas", "postgresql", "bootstrap", "storage", "affinity",
    }  # fmt: skip
    assert set(spec) <= allowed, set(spec) - allowed
    assert spec["instances"] >= 3
    assert spec["minSyncReplicas"] >= 1
    assert spec["maxSyncReplicas"] == spec["instances"] - 1
    assert re.fullmatch(r"ghcr\.io/cloudnative-pg/postgresql:\d+\.\d+", spec["imageName"])
    initdb = spec["bootstrap"]["initdb"]
    assert "GRANT pg_monitor TO " + initdb["owner"] in initdb["postInitApplicationSQL"]
    assert int(spec["postgresql"]["parameters"]["max_connections"]) >= 250
    assert spec["affinity"]["enablePodAntiAffinity"] is True


def test_the_gateway_reaches_the_cnpg_primary_through_its_read_write_service() -> None:
    cluster = one("Cluster")
    url = sa.make_url(named("Secret", "fencegate-secrets")["stringData"]["FENCEGATE_DATABASE_URL"])
    initdb = cluster["spec"]["bootstrap"]["initdb"]
    assert url.host == f"{cluster['metadata']['name']}-rw"
    assert (url.username, url.database) == (initdb["owner"], initdb["database"])
