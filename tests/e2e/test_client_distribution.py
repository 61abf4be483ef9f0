"""``fencegate-client`` is a distribution of its own: ``pip install ./client`` into a
fresh virtual environment brings the worker client and its two HTTP libraries, and none
of the server's dependencies (a database driver, SQLAlchemy, alembic, botocore)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client"
SERVER_ONLY = ("sqlalchemy", "asyncpg", "alembic", "botocore", "aiosqlite", "pydantic")


def test_the_client_declares_no_server_dependency() -> None:
    """The cheap half of the check below: the client's base dependencies name no server
    library, and the server depends on the client by name, pinned to its version."""
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    server = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for requirement in client["dependencies"]:
        assert not requirement.lower().startswith(SERVER_ONLY), requirement
    assert f"{client['name']}=={client['version']}" in server["dependencies"]
    # The server's extras of the integrations pass through to the client's.
    for extra in client["optional-dependencies"]:
        assert server["optional-dependencies"][extra] == [f"fencegate-client[{extra}]"]


def test_no_module_of_the_client_imports_the_server() -> None:
    """The gateway may import the client, never the other way round."""
    for path in sorted((CLIENT / "fencegate_client").rglob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert not words[1].startswith(("lease_core", "gateway")), f"{path}: {line}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pip_install_client_alone(tmp_path: Path) -> None:
    """``pip install ./client`` in a fresh venv: no sqlalchemy, asyncpg, alembic or
    botocore, and ``import fencegate_client.sync, fencegate_client.aio`` works there."""
    # A copy, so that the build leaves no build/ or egg-info in the tree.
    src = tmp_path / "client"
    shutil.copytree(
        CLIENT, src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    )
    venv = tmp_path / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", str(src)],
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    code = (
        "import importlib.metadata as md, importlib.util as u, json, sys; "
        "import fencegate_client.sync, fencegate_client.aio; "
        "print(json.dumps([sorted(d.metadata['Name'].lower() for d in md.distributions()), "
        "{m: u.find_spec(m) is not None for m in sys.argv[1:]}, "
        "fencegate_client.sync.__file__]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", code, *SERVER_ONLY, "gateway", "lease_core"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    distributions, found, module = json.loads(done.stdout)
    assert "fencegate-client" in distributions
    assert "fencegate" not in distributions
    assert {"aiohttp", "httpx"} <= set(distributions)
    assert not [name for name, there in found.items() if there], found
    assert Path(module).is_relative_to(venv)
