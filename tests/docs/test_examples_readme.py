"""What the docs tell a newcomer to run, as written:

- every ``zkServer.sh`` command in docs/, README.md, CONTRIBUTING.md and examples/ names
  the script by the path Debian's ``zookeeper`` package installs it at (it is not on
  ``PATH``), the path the tests start it from; examples/README.md shows the command that
  starts ZooKeeper for the ZooKeeper example, and the package's own configuration serves
  the port examples/lease_sources.toml names, with the data folder the README says
  (checked where the package is installed);
- examples/README.md's table has one row for every file in examples/, and no other;
- examples/lease_sources.toml's header comment names each of its sources and its kind;
  each source has a file of its own in examples/lease_sources/ (the same settings, that
  source alone), which examples/README.md and the combined file's header name.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from verify.zookeeper import SCRIPT as ZK_SCRIPT

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ZK_START = f"{ZK_SCRIPT} start-foreground"
ZK_PACKAGE_CONFIG = Path("/etc/zookeeper/conf/zoo.cfg")
# A zkServer.sh command: the script as written (with whatever path precedes it) and an
# action, possibly on the next line of a paragraph.
ZK_COMMAND = re.compile(r"(\S*zkServer\.sh)`?\s+`?(start-foreground|start|stop|restart|status)")


def instruction_files() -> list[Path]:
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    files += sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".md", ".py", ".sh", ".toml"))
    return files


def test_every_zookeeper_command_names_the_script_by_its_debian_path() -> None:
    commands = []
    for path in instruction_files():
        for match in ZK_COMMAND.finditer(path.read_text(encoding="utf-8")):
            script = match.group(1).strip("`(\"'")
            where = f"{path.relative_to(ROOT)}: {match.group(0)!r}"
            assert script == ZK_SCRIPT, f"{where}: not {ZK_SCRIPT}"
            commands.append(where)
    assert commands


def test_the_examples_readme_shows_how_to_start_zookeeper() -> None:
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```sh\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert any(ZK_START in block.splitlines() for block in blocks), ZK_START
    assert any("apt-get install zookeeper" in block for block in blocks)


def test_the_packages_configuration_serves_the_example_configs_port() -> None:
    if not ZK_PACKAGE_CONFIG.exists():
        pytest.skip(f"no {ZK_PACKAGE_CONFIG} (apt-get install zookeeper)")
    settings = dict(
        line.split("=", 1)
        for line in ZK_PACKAGE_CONFIG.read_text(encoding="utf-8").splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    )
    config = tomllib.loads((EXAMPLES / "lease_sources.toml").read_text(encoding="utf-8"))
    (zk,) = (s for s in config["lease_sources"] if s["kind"] == "zookeeper")
    assert zk["hosts"] == [f"127.0.0.1:{settings['clientPort'].strip()}"]
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    assert f"data in `{settings['dataDir'].strip()}`" in readme


def example_files() -> set[str]:
    """The files of examples/ (not README.md, nor what .gitignore keeps out of git: a
    SQLite database the gateway made there, caches)."""
    ignored = [
        line.strip().rstrip("/")
        for line in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return {
        path.name
        for path in EXAMPLES.iterdir()
        if path.is_file()
        and path.name != "README.md"
        and not any(fnmatch.fnmatch(path.name, pattern) for pattern in ignored)
    }


def test_the_examples_table_lists_every_example() -> None:
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \[`([^`]+)`\]\(([^)]+)\) \| (.+) \|$", readme, re.MULTILINE)
    listed = [name for name, _, _ in rows]
    assert len(listed) == len(set(listed)), "a file has two rows"
    for name, target, what in rows:
        assert target == name, f"{name}'s row links {target}"
        assert what.strip(), f"{name}'s row says nothing"
    assert set(listed) == example_files(), (
        f"missing from the table: {sorted(example_files() - set(listed))}; "
        f"not in examples/: {sorted(set(listed) - example_files())}"
    )


# How the header of lease_sources.toml calls each kind.
KIND_WORDS = {
    "etcd": "etcd locks",
    "zookeeper": "ZooKeeper locks",
    "jwt": "signed tokens",
    "redis": "Redis locks",
    "dynamodb": "DynamoDB lock items",
}


def test_the_lease_sources_example_header_names_every_source() -> None:
    text = (EXAMPLES / "lease_sources.toml").read_text(encoding="utf-8")
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    header = " ".join(line.removeprefix("#").strip() for line in lines[:first])
    sources = tomllib.loads(text)["lease_sources"]
    assert sources
    for source in sources:
        named = KIND_WORDS[source["kind"]]
        assert named in header, f"the header does not name {source['kind']} ({named!r})"
        assert f'("{source["name"]}")' in header, f"the header does not name {source['name']}"


def test_each_source_has_a_file_of_its_own_with_the_same_settings() -> None:
    """examples/lease_sources/KIND.toml is lease_sources.toml with that source alone, so
    a newcomer tries etcd without AWS credentials or a ZooKeeper."""
    combined_text = (EXAMPLES / "lease_sources.toml").read_text(encoding="utf-8")
    combined = tomllib.loads(combined_text)
    kinds = [source["kind"] for source in combined["lease_sources"]]
    folder = EXAMPLES / "lease_sources"
    assert sorted(p.stem for p in folder.glob("*.toml")) == sorted(kinds)
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for source in combined["lease_sources"]:
        alone = tomllib.loads((folder / f"{source['kind']}.toml").read_text(encoding="utf-8"))
        assert alone == combined | {"lease_sources": [source]}, source["kind"]
        assert f"lease_sources/{source['kind']}.toml" in readme, source["kind"]
    assert "examples/lease_sources/etcd.toml" in combined_text
