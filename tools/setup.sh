#!/usr/bin/env bash
# Install what flow needs on Debian 12 as root, skipping what is already there:
# PostgreSQL 15 and build packages, cargo-pgrx 0.18.1, `cargo pgrx init`, and a
# Python venv for the integration tests. Then build and install flow.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/flow-target}
VENV=${FLOW_VENV:-/var/tmp/flow-venv}
step() { printf '== %s\n' "$*"; }

PKGS="postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo build-essential pkg-config graphviz python3-venv"
missing=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  step "apt-get install" $missing
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

command -v cargo >/dev/null || { echo "cargo (Rust) is required: install it with rustup" >&2; exit 1; }
if ! cargo pgrx --version 2>/dev/null | grep -qx "cargo-pgrx 0.18.1"; then
  step "cargo install cargo-pgrx 0.18.1 (about 6 minutes)"
  cargo install cargo-pgrx --version 0.18.1 --locked
fi
if ! grep -qs 'pg15 = "/usr/lib/postgresql/15/bin/pg_config"' ~/.pgrx/config.toml; then
  step "cargo pgrx init"
  cargo pgrx init --pg15 /usr/lib/postgresql/15/bin/pg_config >/dev/null
fi

if ! "$VENV/bin/python" -c 'import psycopg, pytest' 2>/dev/null; then
  step "python venv for the integration tests"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q 'psycopg[binary]==3.2.*' 'pytest==8.*'
fi

step "build and install flow"
# Never replace the library under a running cluster of ours: it is mapped in.
for dir in /tmp/flow-it /tmp/flow-demo /tmp/flow-bench /tmp/flow-bare; do
  FLOW_PGDIR=$dir tools/cluster.sh stop
done
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config 2>&1 | grep -E "error|warning: unused" || true
test -f /usr/lib/postgresql/15/lib/flow.so
# The upgrade script from the last release carries the functions just installed.
python3 tools/upgrade_script.py /usr/lib/postgresql/15/bin/pg_config
