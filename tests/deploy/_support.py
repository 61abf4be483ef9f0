"""Helpers shared by the deploy tests: paths, a small Dockerfile reader, YAML loading and
the PostgreSQL admin connection."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import pg_admin, pg_url_of

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
CONFIG = DEPLOY / "fencegate.toml"
CONFIG_IN_IMAGE = "/etc/fencegate/fencegate.toml"


ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:[:?\-][^}]*)?\}")


# -- YAML ------------------------------------------------------------------------------


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML file."""
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def kubernetes_files() -> list[Path]:
    return sorted(p for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def kubernetes_manifests() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in kubernetes_files() for doc in load_yaml_documents(path)]


def env_refs(text: str) -> set[str]:
    """Names used as ``${NAME}``, ``${NAME:-x}`` or ``${NAME:?x}`` in a text."""
    return set(ENV_REF.findall(text))


# -- Dockerfile ------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    value: str  # the rest of the instruction, continuation lines joined
    stage: int  # index of the FROM stage it belongs to (-1 before the first FROM)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, ``\\`` continuations joined."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may also sit between continuation lines
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical = (pending + line).strip()
        pending = ""
        keyword, _, value = logical.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, value.strip(), stage))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


def exec_form(value: str) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT / CMD / HEALTHCHECK CMD."""
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), value
    return parsed


def healthcheck_command(instructions: list[Instruction]) -> list[str]:
    """The command of the (last) HEALTHCHECK instruction, as argv."""
    checks = [i for i in instructions if i.keyword == "HEALTHCHECK"]
    assert checks, "no HEALTHCHECK"
    _, sep, command = checks[-1].value.partition("CMD ")
    assert sep, f"HEALTHCHECK without CMD: {checks[-1].value}"
    command = command.strip()
    return exec_form(command) if command.startswith("[") else ["/bin/sh", "-c", command]


def copy_sources(instructions: list[Instruction], stage: int | None = None) -> list[str]:
    """Sources of the COPY / ADD instructions that read the build context."""
    sources: list[str] = []
    for item in instructions:
        if item.keyword not in ("COPY", "ADD") or (stage is not None and item.stage != stage):
            continue
        words = shlex.split(item.value)
        if any(w.startswith("--from") for w in words):
            continue
        args = [w for w in words if not w.startswith("--")]
        sources.extend(args[:-1])
    return sources


def dockerignore_patterns(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    """Whether .dockerignore patterns leave ``relative`` (or a folder above it) out of the
    build context. Covers the pattern forms used here (no ``!`` exceptions)."""
    parts = relative.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for pattern in patterns:
        assert not pattern.startswith("!"), "exceptions are not handled by this check"
        pattern = pattern.strip("/")
        for candidate in candidates:
            if fnmatch.fnmatchcase(candidate, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(
                candidate.rsplit("/", 1)[-1], pattern[3:]
            ):
                return True
    return False


# -- PostgreSQL ------------------------------------------------------------------------


def pg_admin_sync(sql: str, timeout: float = 15) -> None:
    asyncio.run(asyncio.wait_for(pg_admin(sql), timeout))


def database_url(name: str) -> str:
    return pg_url_of(name)
