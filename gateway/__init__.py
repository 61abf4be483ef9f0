"""Fencegate's fencing gateway: a reverse proxy that lets only current, new writes through.

The rooms, each importing only the rooms below it (checked by import-linter in .ci/run,
the contracts in pyproject.toml):

- ``service``: the process: ``serve``, the CLI, the control listener (lease API, admin,
  dashboard), TLS, authentication, periodic tasks.
- ``proxy``: one fenced request's path: intake, the admission and its answer, the body,
  duplicates that wait, the forward, unknown outcomes resolved.
- ``records``: the gateway's own tables (keys' records, the audit) and the database's
  shape (schema, migrations, replication).
- ``upstream``: the HTTP client to the destinations, forwarding, hop-by-hop headers, S3
  signing.
- ``sources``: lease sources other than the gateway's own (signed tokens, etcd, ZooKeeper,
  Redis, DynamoDB).
- ``observe``: logs, metrics, traces.
- ``config``: the settings and their validation.
- ``fencing``: the rules, pure (no I/O): the decision table, the fence, the answers after
  the forward, the upstream profiles.
"""
