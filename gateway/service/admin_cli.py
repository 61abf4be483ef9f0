"""The operator's commands over the database and the configuration, the command-line
twin of the admin API: ``jobs`` (list, show, purge), ``audit``, ``upstreams`` and
``outcomes`` (list, resolve)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING, Any

from gateway.config import Settings
from gateway.service.cli_common import EXIT_USAGE, open_store, print_table
from lease_core.store import rfc3339

if TYPE_CHECKING:
    from gateway.records.store import GatewayStore


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


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.records.audit import Audit, AuditQuery, check_reason, check_replica, parse_time

    if not 1 <= args.limit <= 500:
        print("fencegate: --limit must be from 1 to 500", file=sys.stderr)
        return EXIT_USAGE
    query = AuditQuery(
        job_id=args.job_id,
        reason=args.reason,
        upstream=args.upstream,
        source=args.source,
        replica=args.replica,
        since=parse_time(args.since, "since") if args.since else None,
        until=parse_time(args.until, "until") if args.until else None,
        limit=args.limit,
        cursor=args.cursor,
    )

    check_reason(args.reason)  # before the database is opened
    check_replica(args.replica)

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
    _print_audit(items)
    if next_cursor:
        print(f"\nmore: --cursor {next_cursor}")
    return 0


def _print_audit(items: list[dict[str, Any]]) -> None:
    """The audit's entries as a table, one row each."""
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
            e["replica"] or "-",
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
            "REPLICA",
        ],
        rows,
    )


def _gen(generation: int | None, highest: int | None) -> str:
    """``GENERATION/HIGHEST`` as the JSON has them, ``-`` for one not known: a lease
    source's lock that is gone (an etcd key, a ZooKeeper node) took its generation along,
    yet the highest known still shows (``-/8``)."""
    if highest is None:
        return "-" if generation is None else str(generation)
    return f"{'-' if generation is None else generation}/{highest}"


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
    from gateway.proxy.gateway import Gateway

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
                return await _resolve(args, store)
            items = await store.list_unknown()
        if args.json:
            print(
                json.dumps(
                    {"items": [{**i, "updated_at": rfc3339(i["updated_at"])} for i in items]},
                    indent=2,
                )
            )
            return 0
        _print_unknown(items)
        return 0

    return asyncio.run(run())


async def _resolve(args: argparse.Namespace, store: GatewayStore) -> int:
    """``outcomes resolve JOB KEY``: the operator's verdict on one unknown outcome."""
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
            f"fencegate: no unknown outcome for key {args.key!r} of job {args.job_id!r}",
            file=sys.stderr,
        )
        return 1
    print(f"resolved {args.job_id} {args.key}: {'applied' if args.applied else 'not applied'}")
    return 0


def _print_unknown(items: list[dict[str, Any]]) -> None:
    """The unknown outcomes as a table: who settles each (the gateway or the operator)."""
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
