#!/usr/bin/env bash
# flow's main job, end to end: install what is missing, build and install
# flow, start a local PostgreSQL 15 with flow preloaded, run the order
# workflow (examples/order_workflow.sql) and print its result and run graph.
# The server is left running: tools/cluster.sh psql opens a session on it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
export FLOW_PGDIR=${FLOW_PGDIR:-/tmp/flow-demo} FLOW_PGPORT=${FLOW_PGPORT:-5498}
echo "== start PostgreSQL with shared_preload_libraries = 'flow' ($FLOW_PGDIR, port $FLOW_PGPORT)"
tools/cluster.sh start "flow.workers = 2"
psql() { tools/cluster.sh psql -q -v ON_ERROR_STOP=1 "$@"; }
psql -f examples/order_workflow.sql >/dev/null
run=$(psql -At -c "SELECT flow.enqueue('place_order', '{\"order\": \"order-7\", \"amount\": 10, \"sku\": \"book\"}', key => 'order-7')")
echo "== enqueued run $run; waiting for it"
psql -c "SELECT status, result FROM flow.await('$run', '30 seconds')"
psql -c "SELECT key, name, status, attempts, result FROM flow.commands WHERE run_id = '$run' ORDER BY created_at"
echo "== run graph (Graphviz DOT; render with: dot -Tsvg)"
psql -At -c "SELECT flow.run_graph('$run', 'dot')"
saga=$(psql -At -c "SELECT flow.enqueue('place_order', '{\"order\": \"order-8\", \"amount\": 5, \"sku\": \"unicorn\", \"within\": \"3 seconds\"}', key => 'order-8')")
echo "== order-8 asks for a unicorn: the stock never arrives, so ship compensates (run $saga)"
psql -c "SELECT status, error->>'message' AS error FROM flow.await('$saga', '30 seconds')"
psql -c "SELECT order_id, amount, refunded FROM shop.charges ORDER BY order_id"
echo "== the server is still running: FLOW_PGDIR=$FLOW_PGDIR FLOW_PGPORT=$FLOW_PGPORT tools/cluster.sh psql"
