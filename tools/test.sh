#!/usr/bin/env bash
# The whole test suite: #[pg_test] unit tests in a pgrx-managed server, then
# the integration tier (pytest, pg_test/) against a real cluster with
# shared_preload_libraries = 'flow', including crash and fault tests.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/flow-target}
VENV=${FLOW_VENV:-/var/tmp/flow-venv}

echo "== cargo fmt --check"
if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --check
else
  echo "(rustfmt is not installed with this toolchain: formatting not checked)"
fi

echo "== cargo pgrx test (as postgres)"
rm -rf /tmp/flow-pgrx-test
cargo pgrx test pg15 --runas postgres --pgdata /tmp/flow-pgrx-test

echo "== reinstall the release library (pgrx test installed its test build)"
tools/cluster.sh stop
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/dev/null 2>&1

echo "== integration tests (pg_test/)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider pg_test "$@"
