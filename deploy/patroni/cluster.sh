#!/usr/bin/env bash
# A replicated PostgreSQL on this machine, for trying Fencegate across a failover: etcd
# and three PostgreSQL instances run by Patroni, every standby synchronous (what
# `fencegate serve` requires; --async makes the cluster it refuses). It prints the
# database_url to give the gateway and the patronictl commands for a switchover, and
# runs until Ctrl-C (or SIGTERM), which stops everything and removes FOLDER.
#
#   deploy/patroni/cluster.sh [FOLDER] [--async] [--members N]
#
# Needs Debian's patroni and etcd-server packages and the PostgreSQL 15 server binaries
# (/usr/lib/postgresql/15/bin, or FENCEGATE_FAULTS_PG_BIN), and the project's .venv
# (README.md). As root, Patroni and PostgreSQL run as the postgres OS user.
set -euo pipefail
cd "$(dirname "$0")/../.."
for command in patroni patronictl etcd; do
  if ! command -v "$command" >/dev/null 2>&1; then
    echo "cluster.sh: $command is missing: apt-get install patroni etcd-server" >&2
    exit 2
  fi
done
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  exec .venv/bin/python -m verify.patroni --help
elif [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  folder="$1"
  shift
else
  folder="$(mktemp -d /tmp/fencegate-patroni-XXXXXX)"
fi
exec .venv/bin/python -m verify.patroni "$folder" "$@"
