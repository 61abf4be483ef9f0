"""The ``fencegate`` command. Settings are built once here and passed down."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from lease_core import exceptions as lease_exc
from lease_core.db import create_engine
from lease_core.store import LeaseStore, rfc3339

from . import migrate
from .config import DEFAULT_CONFIG_FILE, ConfigError, Settings, load_settings

EXIT_USAGE = 2


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help=f"TOML config file (default: ./{DEFAULT_CONFIG_FILE} when present, else built-in "
        "defaults); FENCEGATE_* variables override it",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fencegate",
        description="Lease service and fencing gateway for job workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="run the proxy and control listeners",
        description="Run the proxy listener and the control listener. On "
        "SQLite the schema is migrated at start; on PostgreSQL run "
        "`fencegate migrate` first.",
    )
    _config_arg(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    p = sub.add_parser(
        "migrate",
        help="upgrade the database schema to the newest revision",
        description="Run the alembic migrations up to head (idempotent).",
    )
    _config_arg(p)

    p = sub.add_parser(
        "check-config",
        help="validate the configuration and print a summary",
        description="Validate the config file and environment; exit 0 when "
        "valid, 2 with one line per bad key otherwise.",
    )
    _config_arg(p)

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace, Settings], int] = COMMANDS[args.command]
    try:
        settings = load_settings(args.config)
    except ConfigError as error:
        print(f"fencegate: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return handler(args, settings)
    except lease_exc.LeaseError as error:
        print(f"fencegate: {error.detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from .server import serve

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(settings))
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    migrate.upgrade(settings.database_url)
    print(f"database at revision {migrate.head_revision()}")
    return 0


def cmd_check_config(args: argparse.Namespace, settings: Settings) -> int:
    print("configuration is valid")
    print(f"  database        {_safe_url(settings.database_url)}")
    print(f"  proxy_listen    {settings.proxy_listen}")
    print(f"  control_listen  {settings.control_listen}")
    print(
        f"  auth            {len(settings.auth.worker_tokens)} worker token(s), "
        f"{len(settings.auth.admin_tokens)} admin token(s)"
    )
    print(
        f"  lease           default ttl {settings.lease.default_ttl_seconds:g}s, "
        f"max ttl {settings.lease.max_ttl_seconds:g}s"
    )
    for upstream in settings.upstreams:
        print(
            f"  upstream        {upstream.name} -> {upstream.url} "
            f"(fenced: {', '.join(upstream.fenced_methods) or 'none'}; "
            f"unknown outcome: {upstream.unknown_outcome})"
        )
    return 0


def _safe_url(url: str) -> str:
    import sqlalchemy as sa

    return sa.make_url(url).render_as_string(hide_password=True)


def cmd_jobs(args: argparse.Namespace, settings: Settings) -> int:
    if args.action in ("show", "purge") and not args.job_id:
        print(f"fencegate: jobs {args.action} needs a JOB_ID", file=sys.stderr)
        return EXIT_USAGE
    if not 1 <= args.limit <= 500:
        print("fencegate: --limit must be from 1 to 500", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(_jobs(args, settings))


async def _jobs(args: argparse.Namespace, settings: Settings) -> int:
    engine = create_engine(settings.database_url)
    try:
        store = LeaseStore(engine)
        if args.action == "show":
            job = await store.get_job(args.job_id)
            print(json.dumps(job.to_json(), indent=2))
            return 0
        if args.action == "purge":
            await store.purge_job(args.job_id)
            print(f"purged job {args.job_id}")
            return 0
        page = await store.list_jobs(
            queue=args.queue, state=args.state, limit=args.limit, cursor=args.cursor
        )
    finally:
        await engine.dispose()
    if args.json:
        print(
            json.dumps(
                {"items": [j.to_json() for j in page.items], "next_cursor": page.next_cursor},
                indent=2,
            )
        )
        return 0
    rows = [
        [
            j.job_id,
            j.queue,
            j.state,
            str(j.generation),
            j.owner or "-",
            rfc3339(j.lease_expires_at) or "-",
            f"{j.attempts}/{j.max_attempts}",
        ]
        for j in page.items
    ]
    print_table(["JOB", "QUEUE", "STATE", "GEN", "OWNER", "LEASE EXPIRES", "ATTEMPTS"], rows)
    if page.next_cursor:
        print(f"\nmore: --cursor {page.next_cursor}")
    return 0


def print_table(header: list[str], rows: list[list[str]]) -> None:
    if not rows:
        print("(none)")
        return
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)
            ).rstrip()
        )


COMMANDS: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "serve": cmd_serve,
    "migrate": cmd_migrate,
    "check-config": cmd_check_config,
    "jobs": cmd_jobs,
}


if __name__ == "__main__":
    sys.exit(main())
