"""The ``fencegate`` command. Settings are built once here and passed down."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import sqlalchemy as sa

from gateway.config import (
    DEFAULT_CONFIG_FILE,
    ConfigError,
    DynamoDbSourceSettings,
    JwtSourceSettings,
    RedisSourceSettings,
    Settings,
    ZooKeeperSourceSettings,
    env_references,
    for_serving,
    load_settings,
    mask_url,
    sqlite_folder_problem,
)
from gateway.records import migrate
from lease_core import exceptions as lease_exc
from lease_core.db import create_engine
from lease_core.store import LeaseStore, rfc3339

EXIT_USAGE = 2


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


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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

    sub.add_parser(
        "demo",
        help="show a stale worker's write refused, step by step",
        description="Start a local upstream and the gateway on a throw-away SQLite file, run "
        "two workers on one job, stall the first past its lease and show its late write "
        "refused. Exits 0 when every check held.",
    )

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
    p.add_argument("--since", help="RFC 3339 time or epoch seconds (inclusive)")
    p.add_argument("--until", help="RFC 3339 time or epoch seconds (exclusive)")
    p.add_argument("--limit", type=int, default=50, help="how many (default 50, max 500)")
    p.add_argument("--cursor", help="continue after this cursor")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser(
        "upstreams",
        help="list the configured upstreams",
        description="The upstreams of the configuration (secrets not shown).",
    )
    _config_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

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
    return parser


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
    try:
        return handler(args, settings)
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


@asynccontextmanager
async def open_store(settings: Settings) -> AsyncIterator[LeaseStore]:
    """The database, at the newest schema (SQLite migrates itself; PostgreSQL must have
    been migrated with `fencegate migrate`)."""
    from gateway.service.server import prepare_database

    engine = create_engine(settings.database_url)
    try:
        store = LeaseStore(engine)
        await prepare_database(settings, store)
        yield store
    finally:
        await engine.dispose()


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (a faster event loop), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.observe.logs import configure
    from gateway.service.server import serve

    try:
        settings = for_serving(settings)
    except ConfigError as error:
        print(f"fencegate: {error}", file=sys.stderr)
        return EXIT_USAGE
    configure(args.log_level, args.log_format, access_log=args.access_log)
    run_loop(
        serve(
            settings,
            reload_settings=lambda: for_serving(load_settings(args.config)),
            freeze_gc=True,
        )
    )
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    try:
        migrate.upgrade(settings.database_url)
    except OSError as error:  # the database's, not a file's: say so like the others
        print(f"fencegate: {migrate.database_error(error, settings.database_url)}", file=sys.stderr)
        return 1
    print(f"database at revision {migrate.head_revision()}")
    return 0


def cmd_check_config(args: argparse.Namespace, settings: Settings) -> int:
    # What serve would run with: the ${NAME} of set_headers resolved here too (only serve
    # and this command read them), named with whether this shell has them, never shown.
    from gateway.service import tls

    try:
        for_serving(settings)
        contexts = tls.contexts(settings)  # the certificate files load, keys fit
    except ConfigError as error:
        problems = [
            f"{p} (serve needs it; the other commands do not)" if p.endswith("is not set") else p
            for p in error.problems
        ]
        print(f"fencegate: {ConfigError(problems)}", file=sys.stderr)
        return EXIT_USAGE
    replicated, refused = _replication_line(settings)
    if refused:
        print(f"fencegate: {refused}", file=sys.stderr)
        return 1
    print("configuration is valid")
    print(f"  database        {_safe_url(settings.database_url)}")
    if replicated:
        print(f"  replication     {replicated}")
    print(f"  proxy_listen    {settings.proxy_listen}")
    print(f"  control_listen  {settings.control_listen}")
    print(
        f"  auth            {len(settings.auth.worker_tokens)} worker token(s), "
        f"{len(settings.auth.admin_tokens)} admin token(s), "
        f"{len(settings.auth.metrics_tokens)} metrics token(s)"
    )
    for name, listener in settings.tls.listeners.items():
        client = (
            ""
            if listener.client_certs == "none"
            else f", client certificates {listener.client_certs}"
        )
        print(f"  tls             {name} listener: {listener.cert_file}{client}")
    if not contexts:
        print("  tls             off (both listeners speak plain HTTP)")
    print(
        f"  lease           default ttl {settings.lease.default_ttl_seconds:g}s, "
        f"max ttl {settings.lease.max_ttl_seconds:g}s"
    )
    for upstream in settings.upstreams:
        print(
            f"  upstream        {upstream.name} -> {upstream.display_url} "
            f"(fenced: {', '.join(upstream.fenced_methods) or 'none'}; "
            f"unknown outcome: {upstream.unknown_outcome})"
        )
    for source in settings.lease_sources:
        if isinstance(source, JwtSourceSettings):
            what = f"issuer {source.issuer!r}, {', '.join(source.algorithms)}"
        elif isinstance(source, ZooKeeperSourceSettings):
            what = ", ".join(source.hosts)
        elif isinstance(source, RedisSourceSettings):
            what = mask_url(source.url)
        elif isinstance(source, DynamoDbSourceSettings):
            what = f"table {source.table}, {source.region}"
            what += f", {source.endpoint_url}" if source.endpoint_url else ""
        else:
            what = ", ".join(mask_url(e) for e in source.endpoints)
        print(f"  lease source    {source.name}: {source.kind} ({what}); tokens {source.name}:...")
    for key, name, _ in env_references(settings):
        print(f"  serve needs     {name} (set) for {key}")
    return 0


def _replication_line(settings: Settings) -> tuple[str, str]:
    """(what check-config says of a PostgreSQL's replication, the refusal serve would
    give or ""). An unreachable database is said, not refused: the file is what is checked."""
    from gateway.records import replication

    if settings.sqlite:
        return "", ""
    seen: list[replication.Replication] = []

    async def read() -> None:
        engine = create_engine(settings.database_url)
        try:
            seen.append(await replication.replication(engine))
        finally:
            await engine.dispose()

    try:
        run_loop(read())
    except Exception as error:
        return f"not checked: {migrate.database_error(error, settings.database_url)}", ""
    refused = seen[0].refusal(settings.database.allow_async_failover)
    if refused is not None:
        return "", refused
    if seen[0].problems():
        return f"{seen[0].summary()}; can lose commits (allow_async_failover = true)", ""
    return seen[0].summary(), ""


def _safe_url(url: str) -> str:
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
    async with open_store(settings) as store:
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


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.records.audit import Audit, AuditQuery, check_reason, parse_time

    if not 1 <= args.limit <= 500:
        print("fencegate: --limit must be from 1 to 500", file=sys.stderr)
        return EXIT_USAGE
    query = AuditQuery(
        job_id=args.job_id,
        reason=args.reason,
        upstream=args.upstream,
        source=args.source,
        since=parse_time(args.since, "since") if args.since else None,
        until=parse_time(args.until, "until") if args.until else None,
        limit=args.limit,
        cursor=args.cursor,
    )

    check_reason(args.reason)  # before the database is opened

    async def run() -> tuple[list[dict[str, Any]], str | None]:
        async with open_store(settings) as store:
            return await Audit(store).query(
                query,
                upstreams=[u.name for u in settings.upstreams],
                sources=[s.name for s in settings.lease_sources],
            )

    items, next_cursor = asyncio.run(run())
    if args.json:
        print(json.dumps({"items": items, "next_cursor": next_cursor}, indent=2))
        return 0
    rows = [
        [
            e["at"],
            e["reason"],
            str(e["status"]),
            str(e["count"]),
            e["source"] or "-",
            e["job_id"] or "-",
            _gen(e["generation"], e["highest_generation"]),
            e["upstream"] or "-",
            f"{e['method']} {e['path']}",
            e["idempotency_key"] or "-",
        ]
        for e in items
    ]
    print_table(
        [
            "AT",
            "REASON",
            "STATUS",
            "COUNT",
            "SOURCE",
            "JOB",
            "GEN/HIGHEST",
            "UPSTREAM",
            "REQUEST",
            "KEY",
        ],
        rows,
    )
    if next_cursor:
        print(f"\nmore: --cursor {next_cursor}")
    return 0


def _gen(generation: int | None, highest: int | None) -> str:
    if generation is None:
        return "-"
    return f"{generation}/{highest}" if highest is not None else str(generation)


def cmd_upstreams(args: argparse.Namespace, settings: Settings) -> int:
    items = [u.summary() for u in settings.upstreams]
    if args.json:
        print(json.dumps({"items": items}, indent=2))
        return 0
    print_table(
        ["NAME", "URL", "FENCED", "KEY", "TIMEOUT", "UNKNOWN OUTCOME", "SETS HEADERS"],
        [
            [
                i["name"],
                i["url"],
                ",".join(i["fenced_methods"]) or "-",
                "required" if i["require_idempotency_key"] else "optional",
                f"{i['timeout_seconds']:g}s",
                i["unknown_outcome"],
                ",".join(i["set_headers"]) or "-",
            ]
            for i in items
        ],
    )
    return 0


def cmd_outcomes(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.proxy.handler import Gateway

    if args.action == "resolve":
        if not (args.job_id and args.key) or not (args.applied or args.not_applied):
            print(
                "fencegate: outcomes resolve JOB KEY needs --applied or --not-applied",
                file=sys.stderr,
            )
            return EXIT_USAGE
        if args.applied and args.status is None:
            print(
                "fencegate: --applied needs --status (what later duplicates get)", file=sys.stderr
            )
            return EXIT_USAGE

    async def run() -> int:
        async with open_store(settings) as lease_store:
            store = Gateway(settings, lease_store).store
            if args.action == "resolve":
                done = await store.resolve(
                    args.job_id,
                    args.key,
                    applied=args.applied,
                    status=args.status,
                    headers=[("Content-Type", args.content_type)] if args.applied else None,
                    body=args.body.encode(),
                )
                if not done:
                    print(
                        f"fencegate: no unknown outcome for key {args.key!r} of job "
                        f"{args.job_id!r}",
                        file=sys.stderr,
                    )
                    return 1
                print(
                    f"resolved {args.job_id} {args.key}: "
                    f"{'applied' if args.applied else 'not applied'}"
                )
                return 0
            items = await store.list_unknown()
        if args.json:
            print(
                json.dumps(
                    {"items": [{**i, "updated_at": rfc3339(i["updated_at"])} for i in items]},
                    indent=2,
                )
            )
            return 0
        print_table(
            [
                "JOB",
                "KEY",
                "GEN",
                "UPSTREAM",
                "STATE",
                "WAITS FOR",
                "REQUEST",
                "STATUS",
                "NOTE",
                "SINCE",
            ],
            [
                [
                    i["job_id"],
                    i["key"],
                    str(i["generation"]),
                    i["upstream"],
                    f"{i['state']} ({i['resolve_attempts']} re-sent)"
                    if i["resolve_attempts"]
                    else i["state"],
                    "gateway" if i["state"] == "resolving" or i["resolvable"] else "operator",
                    f"{i['method']} /{i['path']}",
                    str(i["status"] or "-"),
                    i["note"] or "-",
                    rfc3339(i["updated_at"]) or "-",
                ]
                for i in items
            ],
        )
        return 0

    return asyncio.run(run())


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
