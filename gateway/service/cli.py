"""The ``fencegate`` command: the parser and the dispatch. Settings are built once here
and passed down to the subcommands, whose bodies live by theme in ``serve_cli`` (serve,
migrate), ``check_config`` and ``admin_cli`` (jobs, audit, upstreams, outcomes)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeAlias

import sqlalchemy as sa

from gateway.config import (
    DEFAULT_CONFIG_FILE,
    ConfigError,
    Settings,
    load_settings,
    sqlite_folder_problem,
)
from gateway.records import migrate
from gateway.service.admin_cli import cmd_audit, cmd_jobs, cmd_outcomes, cmd_upstreams
from gateway.service.check_config import cmd_check_config
from gateway.service.cli_common import EXIT_USAGE
from gateway.service.serve_cli import cmd_migrate, cmd_serve
from lease_core import exceptions as lease_exc


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake answered in one line (what is wrong, the valid values,
    where to read more) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help=f"TOML config file (default: ./{DEFAULT_CONFIG_FILE} when present, else built-in "
        "defaults); FENCEGATE_* variables override it",
    )


def version() -> str:
    """``fencegate <version> (schema <revision>)``: the installed distribution's version
    and the schema revision this code migrates to and serves."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        number = installed("fencegate")
    except PackageNotFoundError:  # run from a checkout that is not installed
        from lease_core import __version__ as number
    return f"fencegate {number} (schema {migrate.head_revision()})"


class _Version(argparse.Action):
    """``--version``: printed and exit 0 (worked out only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version())
        parser.exit(0)


# ``serve --workers``' bound: more processes than this is a typo, not a machine.
MAX_WORKERS = 256

# What ``add_subparsers`` returns: each ``_<command>`` below adds its subcommand to it.
Commands: TypeAlias = "argparse._SubParsersAction[Parser]"


def build_parser() -> argparse.ArgumentParser:
    """The ``fencegate`` parser: one subcommand each, in the order ``--help`` lists them."""
    parser = Parser(
        prog="fencegate",
        description="Lease service and fencing gateway for job workers.",
    )
    parser.add_argument("--version", "-V", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_serve, _migrate, _check_config, _jobs, _demo, _audit, _upstreams, _outcomes):
        add(sub)
    return parser


def _serve(sub: Commands) -> None:
    """``serve``: the listeners, and how it logs."""
    p = sub.add_parser(
        "serve",
        help="run the proxy and control listeners",
        description="Run the proxy listener and the control listener. On "
        "SQLite the schema is migrated at start; on PostgreSQL run "
        "`fencegate migrate` first.",
    )
    _config_arg(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--log-format",
        default="auto",
        choices=["auto", "json", "text"],
        help="json (one object per line), text, or auto: text on a terminal, else json",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (refusals, errors and upstream failures are always logged)",
    )
    p.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N",
        help="processes serving both listeners' ports (default 1: this process alone); "
        "with N > 1 this process binds the ports, starts N workers, replaces one that "
        "dies and stops them all on SIGTERM (docs/operations.md, Several workers)",
    )


def _workers(text: str) -> int:
    """``--workers``: a whole number from 1 to ``MAX_WORKERS``."""
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_WORKERS}")
    return int(text)


def _migrate(sub: Commands) -> None:
    """``migrate``: the schema up to head."""
    p = sub.add_parser(
        "migrate",
        help="upgrade the database schema to the newest revision",
        description="Run the alembic migrations up to head (idempotent).",
    )
    _config_arg(p)


def _check_config(sub: Commands) -> None:
    """``check-config``: the settings checked and summed up."""
    p = sub.add_parser(
        "check-config",
        help="validate the configuration and print a summary",
        description="Validate the config file and environment; exit 0 when "
        "valid, 2 with one line per bad key otherwise.",
    )
    _config_arg(p)


def _jobs(sub: Commands) -> None:
    """``jobs``: list, show or purge jobs."""
    p = sub.add_parser(
        "jobs",
        help="list jobs, show one, or purge one",
        description="Read jobs straight from the database.",
    )
    _config_arg(p)
    p.add_argument("action", nargs="?", default="list", choices=["list", "show", "purge"])
    p.add_argument("job_id", nargs="?", help="job id (for show and purge)")
    p.add_argument("--queue", help="only jobs of this queue")
    p.add_argument("--state", choices=["pending", "leased", "completed", "failed"])
    p.add_argument("--limit", type=int, default=50, help="how many (default 50)")
    p.add_argument("--cursor", help="continue after this cursor")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _demo(sub: Commands) -> None:
    """``demo``: a stale write refused, step by step (reads no settings)."""
    sub.add_parser(
        "demo",
        help="show a stale worker's write refused, step by step",
        description="Start a local upstream and the gateway on a throw-away SQLite file, run "
        "two workers on one job, stall the first past its lease and show its late write "
        "refused. Exits 0 when every check held.",
    )


def _audit(sub: Commands) -> None:
    """``audit``: the gateway's own answers, filtered."""
    p = sub.add_parser(
        "audit",
        help="show requests the gateway answered itself",
        description="Rejections and replays, newest first, from the database.",
    )
    _config_arg(p)
    p.add_argument("--job", dest="job_id", help="only this job")
    p.add_argument("--reason", help="only this reason (e.g. stale-generation)")
    p.add_argument("--upstream", help="only this upstream")
    p.add_argument("--source", help="only this lease source (fencegate: the gateway's own leases)")
    p.add_argument("--replica", help="only what this replica answered (its gateway.replica_name)")
    p.add_argument("--since", help="RFC 3339 time or epoch seconds (inclusive)")
    p.add_argument("--until", help="RFC 3339 time or epoch seconds (exclusive)")
    p.add_argument("--limit", type=int, default=50, help="how many (default 50, max 500)")
    p.add_argument("--cursor", help="continue after this cursor")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _upstreams(sub: Commands) -> None:
    """``upstreams``: the configured upstreams."""
    p = sub.add_parser(
        "upstreams",
        help="list the configured upstreams",
        description="The upstreams of the configuration (secrets not shown).",
    )
    _config_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _outcomes(sub: Commands) -> None:
    """``outcomes``: list unknown outcomes, or resolve one."""
    p = sub.add_parser(
        "outcomes",
        help="list or resolve keys with an unknown outcome",
        description="A forward whose outcome is unknown (timeout, cut "
        "connection, crashed replica) holds its key until resolved: "
        "`outcomes resolve JOB KEY --applied --status 201 --body '{...}'` "
        "makes duplicates replay that answer; `--not-applied` lets the next "
        "request with the key through.",
    )
    _config_arg(p)
    p.add_argument("action", nargs="?", default="list", choices=["list", "resolve"])
    p.add_argument("job_id", nargs="?")
    p.add_argument("key", nargs="?")
    verdict = p.add_mutually_exclusive_group()
    verdict.add_argument("--applied", action="store_true", help="the side effect happened")
    verdict.add_argument("--not-applied", action="store_true", help="it did not happen")
    p.add_argument("--status", type=int, help="status later duplicates get (with --applied)")
    p.add_argument("--body", default="", help="body later duplicates get (with --applied)")
    p.add_argument("--content-type", default="application/json")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from gateway.service.demo import run_demo

        return asyncio.run(run_demo())
    handler: Callable[[argparse.Namespace, Settings], int] = COMMANDS[args.command]
    try:
        settings = load_settings(args.config)
    except ConfigError as error:
        print(f"fencegate: {error}", file=sys.stderr)
        return EXIT_USAGE
    problem = sqlite_folder_problem(settings)
    if problem is not None and args.command != "upstreams":
        print(f"fencegate: {problem}", file=sys.stderr)
        return EXIT_USAGE
    return reported(lambda: handler(args, settings), settings)


def reported(run: Callable[[], int], settings: Settings) -> int:
    """``run()``'s exit code, its failures said in one line each: a command's, and a
    worker's of ``serve --workers`` (``gateway.service.worker``)."""
    try:
        return run()
    except lease_exc.InvalidRequest as error:  # a bad option value: a usage error
        print(f"fencegate: {error.detail}", file=sys.stderr)
        return EXIT_USAGE
    except lease_exc.LeaseError as error:
        print(f"fencegate: {error.detail}", file=sys.stderr)
        return 1
    except sa.exc.SQLAlchemyError as error:
        print(f"fencegate: {migrate.database_error(error, settings.database_url)}", file=sys.stderr)
        return 1
    except OSError as error:  # a listener's port taken, a file not writable, ...
        print(f"fencegate: {error}".splitlines()[0], file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


COMMANDS: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "serve": cmd_serve,
    "migrate": cmd_migrate,
    "check-config": cmd_check_config,
    "jobs": cmd_jobs,
    "audit": cmd_audit,
    "upstreams": cmd_upstreams,
    "outcomes": cmd_outcomes,
}


if __name__ == "__main__":
    sys.exit(main())
