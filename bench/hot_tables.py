"""The soak's heap-only share: for each table a fenced write updates (``pgadmin.HOT_TABLES``,
and jobs, the lease API's, beside them), its updates over the run and the share of them
that PostgreSQL kept heap-only (HOT: no index entry written, the old version pruned from
its page without a vacuum), its dead rows and size at the end. Read from
``pg_stat_user_tables`` before and after the run (``Database.server_state``)."""

from __future__ import annotations

from typing import Any

from bench.pgadmin import HOT_TABLES

HOT_TARGET = 0.90  # issue 47: the settle's HOT share above 90 % in a soak


def hot_tables(change: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per table: updates and HOT updates over the run, the HOT share (None: no update),
    dead rows and MiB (indexes and TOAST included) at the end."""
    tables: dict[str, dict[str, Any]] = {}
    for table in HOT_TABLES:
        if f"updates:{table}" not in change:
            continue
        updates = change[f"updates:{table}"]
        hot = change[f"hot_updates:{table}"]
        tables[table] = {
            "updates": updates,
            "hot_updates": hot,
            "hot_share": hot / updates if updates else None,
            "dead_rows": after[f"dead_rows:{table}"],
            "mib": after[f"bytes:{table}"] / 2**20,
        }
    return tables


def hot_tables_text(tables: dict[str, dict[str, Any]]) -> str:
    """One line per table, the records' share judged against ``HOT_TARGET``."""
    lines = ["heap-only (HOT) updates over the run, per table:"]
    for table, seen in tables.items():
        share = seen["hot_share"]
        judged = ""
        if table == "idempotency_records" and share is not None:
            met = "met" if share > HOT_TARGET else "MISSED"
            judged = f" (target > {100 * HOT_TARGET:.0f} %: {met})"
        shown = "no updates" if share is None else f"{100 * share:.1f} % HOT"
        lines.append(
            f"  {table}: {seen['updates']:,.0f} updates, {seen['hot_updates']:,.0f} HOT, "
            f"{shown}{judged}; {seen['dead_rows']:,.0f} dead rows, {seen['mib']:,.1f} MiB"
        )
    return "\n".join(lines)


def postgres_summary(row: dict[str, Any]) -> list[str]:
    """PostgreSQL over a soak (``row["postgres_change"]``, ``row["postgres_after"]``):
    WAL, checkpoints, the records table, and each hot table's HOT share, which it also
    keeps in the row (``hot_tables``). Nothing for a run without them (SQLite)."""
    change = row.get("postgres_change")
    if not change or not row.get("ok"):
        return []
    after = row["postgres_after"]
    row["hot_tables"] = hot_tables(change, after)
    return [
        f"PostgreSQL over the run: WAL {change['wal_bytes'] / row['ok']:,.0f} bytes "
        f"per write, {change['checkpoints']:.0f} checkpoint(s), "
        f"{change['buffers_backend']:,.0f} buffers written by backends; the records "
        f"table {after['live_rows']:,.0f} live and {after['dead_rows']:,.0f} dead rows "
        f"(autovacuum = {row.get('autovacuum')}, {change['autovacuums']:.0f} autovacuum "
        f"pass(es) over it), {after['records_bytes'] / 2**20:,.0f} MiB with its indexes; "
        f"{after.get('in_flight_bytes', 0.0) / 2**20:,.1f} MiB of writes_in_flight",
        hot_tables_text(row["hot_tables"]),
    ]
