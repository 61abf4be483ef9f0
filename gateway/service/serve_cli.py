"""``fencegate serve`` (both listeners) and ``fencegate migrate`` (the schema to head)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gateway.config import ConfigError, Settings, for_serving, load_settings, unknown_variables
from gateway.records import migrate
from gateway.service.cli_common import EXIT_USAGE, run_loop


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.observe.logs import configure
    from gateway.service.server import serve

    try:
        settings = for_serving(settings)
    except ConfigError as error:
        print(f"fencegate: {error}", file=sys.stderr)
        return EXIT_USAGE
    configure(args.log_level, args.log_format, access_log=args.access_log, pid=args.workers > 1)
    for warning in unknown_variables(os.environ):
        logging.getLogger("fencegate.server").warning("%s", warning)
    if args.workers > 1:
        from gateway.service.workers import serve_workers

        return serve_workers(args, settings, args.workers)
    run_loop(
        serve(
            settings,
            reload_settings=lambda: for_serving(load_settings(args.config)),
            freeze_gc=True,
        )
    )
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    """The schema to this version's head. A schema a newer version migrated (a rolled-back
    deployment runs this step again) is left as it is: nothing to do while its floor lets
    this version serve it, a refusal when not."""
    try:
        schema = migrate.read_schema_state(settings.database_url)
        if schema.ahead:
            below = schema.below_floor()
            if below is not None:
                print(f"fencegate: {below}", file=sys.stderr)
                return 1
            print(
                f"database at revision {schema.revision}, newer than this version's "
                f"{migrate.head_revision()}: nothing to migrate"
            )
            return 0
        migrate.upgrade(settings.database_url)
    except OSError as error:  # the database's, not a file's: say so like the others
        print(f"fencegate: {migrate.database_error(error, settings.database_url)}", file=sys.stderr)
        return 1
    print(f"database at revision {migrate.head_revision()}")
    return 0
