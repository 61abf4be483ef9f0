"""``fencegate --version`` (issue 46): the installed version and the schema revision the
code serves, exit 0, from the installed command."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from gateway.records import migrate
from lease_core import __version__

FENCEGATE = str(Path(sys.executable).with_name("fencegate"))


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_the_version_and_the_schema_it_serves(flag: str) -> None:
    result = subprocess.run([FENCEGATE, flag], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fencegate {version('fencegate')} (schema {migrate.head_revision()})\n"


def test_the_package_and_the_distribution_agree() -> None:
    assert version("fencegate") == __version__
