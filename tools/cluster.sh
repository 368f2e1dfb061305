#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster with flow preloaded, run as the postgres
# OS user (PostgreSQL refuses root).
#   tools/cluster.sh start [extra postgresql.conf lines...]   (re)creates and starts it
#   tools/cluster.sh stop | restart | psql [args] | conf LINE
# Environment: FLOW_PGDIR (default /tmp/flow-it), FLOW_PGPORT (default 5499),
# FLOW_PRELOAD=0 for a cluster without flow preloaded (and no CREATE EXTENSION),
# FLOW_CREATE=0 for one with flow preloaded but not yet created.
set -euo pipefail
PGBIN=/usr/lib/postgresql/15/bin
DIR=${FLOW_PGDIR:-/tmp/flow-it}
PORT=${FLOW_PGPORT:-5499}
as_pg() { if [ "$(id -u)" = 0 ]; then sudo -u postgres "$@"; else "$@"; fi; }

case "${1:-}" in
start)
  shift
  if [ -f "$DIR/pgdata/postmaster.pid" ]; then as_pg $PGBIN/pg_ctl -D "$DIR/pgdata" -m immediate stop >/dev/null 2>&1 || true; fi
  rm -rf "$DIR"
  install -d -o postgres -g postgres -m 700 "$DIR" "$DIR/pgdata"
  as_pg $PGBIN/initdb -D "$DIR/pgdata" -A trust -U postgres --no-sync >/dev/null
  {
    echo "port = $PORT"
    echo "listen_addresses = '127.0.0.1'"
    echo "unix_socket_directories = '$DIR'"
    if [ "${FLOW_PRELOAD:-1}" = 1 ]; then
      echo "shared_preload_libraries = 'flow'"
      echo "flow.database_name = 'postgres'"
    fi
    echo "max_connections = 100"
    echo "max_worker_processes = 24"
    echo "fsync = on"
    for line in "$@"; do echo "$line"; done
  } >> "$DIR/pgdata/postgresql.conf"
  as_pg $PGBIN/pg_ctl -D "$DIR/pgdata" -l "$DIR/pg.log" -w -t 60 start >/dev/null
  if [ "${FLOW_PRELOAD:-1}" = 1 ] && [ "${FLOW_CREATE:-1}" = 1 ]; then
    as_pg $PGBIN/psql -X -q -h "$DIR" -p "$PORT" -U postgres -d postgres -c 'CREATE EXTENSION flow'
  fi
  ;;
conf)
  shift; echo "$1" | as_pg tee -a "$DIR/pgdata/postgresql.conf" >/dev/null ;;
restart)
  as_pg $PGBIN/pg_ctl -D "$DIR/pgdata" -l "$DIR/pg.log" -w -t 60 -m fast restart >/dev/null ;;
stop)
  [ -f "$DIR/pgdata/postmaster.pid" ] && as_pg $PGBIN/pg_ctl -D "$DIR/pgdata" -w -t 60 -m fast stop >/dev/null || true ;;
psql)
  shift; exec psql -X -h "$DIR" -p "$PORT" -U postgres -d postgres "$@" ;;
*)
  echo "usage: $0 start|stop|restart|psql|conf" >&2; exit 2 ;;
esac
