#!/usr/bin/env bash
# Developer loop: build and install flow, then (re)create the test cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/flow-target}
tools/cluster.sh stop
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/dev/null
tools/cluster.sh start "$@"
