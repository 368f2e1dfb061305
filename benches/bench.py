"""flow's throughput and latency benchmark; prints its figures as a table.

    bash tools/setup.sh && /var/tmp/flow-venv/bin/python benches/bench.py
(tools/setup.sh installs the release build; a debug build drains ~30 % slower.)

Runs a throwaway cluster (/tmp/flow-bench, port 5496) with the peers' settings
(shared_buffers 1GB, fsync and synchronous_commit on; ../shared/peers/README.md)
and measures, in one sitting:
  - enqueue: single-row flow.enqueue (one transaction each) and flow.enqueue_many
    (chunks of 1,000), runs/s;
  - W1 drain: 20,000 pre-enqueued no-op runs (flow.noop, and a no-op PL/pgSQL
    handler) with 2 and 4 workers, jobs/s from the moment the queue is unpaused
    until every run has succeeded;
  - the plain-SQL floor of an in-database engine (peers/floor/indb.sql: claim,
    call a no-op in a subtransaction, settle, commit per batch of 100) on the
    same cluster, so flow's drain is reported as a ratio to it;
  - W2 pickup latency: 500 single enqueues 10 ms apart into idle workers; the
    handler records clock_timestamp() - the client's clock just before the
    enqueue call (the peers' definition, includes the enqueue's commit);
  - external workers: one client over TCP claiming with max 1 and max 100 and
    completing a no-op, commands/s.
Peers' figures (W1 drain, W2 p50/p99) come from ../shared/peers/results/latest,
measured earlier on this kind of machine: those ratios are indicative only.
"""
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "pg_test"))
from conftest import Cluster  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers"
N_DRAIN = int(os.environ.get("FLOW_BENCH_DRAIN", 20000))
N_LATENCY = int(os.environ.get("FLOW_BENCH_LATENCY", 500))
# Drains are repeated and reported as median [min-max]: this machine's fsync
# latency swings by 2x or more from minute to minute.
REPEAT = int(os.environ.get("FLOW_BENCH_REPEAT", 3))
SETTINGS = ["shared_buffers = '1GB'", "synchronous_commit = on", "max_wal_size = '1GB'", "flow.batch_size = 100",
            "max_connections = 100"]

rows = []


def report(what, value, unit, ratio="", spread=None):
    rows.append((what, value, unit, ratio))
    shown = f"[{spread[0]:,.0f}-{spread[1]:,.0f}]" if spread else ""
    print(f"  {what:<58} {value:>12,.1f} {unit:<8} {shown:<17} {ratio}", flush=True)


def repeated(measure):
    """Median and range of REPEAT runs of measure()."""
    values = [measure() for _ in range(REPEAT)]
    return statistics.median(values), (min(values), max(values))


def start(workers):
    cluster = Cluster("/tmp/flow-bench", 5496)
    cluster.start(*SETTINGS, f"flow.workers = {workers}")
    cluster.wait_ready()
    with cluster.connect() as c:
        c.execute("""
            CREATE SCHEMA bench;
            CREATE FUNCTION bench.noop(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
            CREATE TABLE bench.pickup (sent double precision, started double precision);
            CREATE FUNCTION bench.pickup(args jsonb) RETURNS void LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO bench.pickup VALUES ((args->>'t')::double precision,
                                                 extract(epoch FROM clock_timestamp()));
            END $$;
            SELECT flow.define('rust_noop', 'flow.noop'::regproc, queue => 'drain');
            SELECT flow.define('plpgsql_noop', 'bench.noop'::regproc, queue => 'drain');
            SELECT flow.define('pickup', 'bench.pickup'::regproc, queue => 'pickup');
            SELECT flow.define('external_noop', NULL, queue => 'external');
        """)
    return cluster


def bench_enqueue(pg):
    with pg.connect() as c:
        c.execute("SELECT flow.set_queue('drain', paused => true)")
        n = 5000
        t0 = time.perf_counter()
        for _ in range(n):
            c.execute("SELECT flow.enqueue('rust_noop', '{}')")
        report("enqueue, single-row (1 client, 1 commit each)", n / (time.perf_counter() - t0), "runs/s")
        t0 = time.perf_counter()
        for _ in range(N_DRAIN // 1000):
            c.execute("SELECT flow.enqueue_many('rust_noop', array_fill('{}'::jsonb, array[1000]))")
        report("enqueue_many, chunks of 1,000", N_DRAIN / (time.perf_counter() - t0), "runs/s")
        c.execute("TRUNCATE flow._runs CASCADE")


def drain(pg, name):
    with pg.connect() as c:
        c.execute("SELECT flow.set_queue('drain', paused => true)")
        for _ in range(N_DRAIN // 1000):
            c.execute("SELECT flow.enqueue_many(%s, array_fill('{}'::jsonb, array[1000]))", (name,))
        c.execute("CHECKPOINT")
        t0 = time.perf_counter()
        c.execute("SELECT flow.set_queue('drain', paused => false)")
        while c.execute("SELECT count(*) FROM flow._runs WHERE status = 'running'").fetchone()[0]:
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        assert c.execute("SELECT count(*) FROM flow._runs WHERE status = 'succeeded'").fetchone()[0] == N_DRAIN
        c.execute("TRUNCATE flow._runs CASCADE")
        c.execute("VACUUM ANALYZE flow._commands")
    return N_DRAIN / elapsed


def floor(pg, sessions):
    with pg.connect() as c:
        c.execute((PEERS / "floor" / "indb.sql").read_text())
        c.execute("INSERT INTO floor.jobs(args) SELECT '{}' FROM generate_series(1, %s)", (N_DRAIN,))
        c.execute("CHECKPOINT")

    def drainer():
        with pg.connect() as c:
            c.execute("CALL floor.drain(100)")

    threads = [threading.Thread(target=drainer) for _ in range(sessions)]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    return N_DRAIN / (time.perf_counter() - t0)


def pickup(pg):
    time.sleep(1.5)
    with pg.connect() as c:
        for _ in range(N_LATENCY):
            t = time.time()
            c.execute("SELECT flow.enqueue('pickup', jsonb_build_object('t', %s::float8))", (t,))
            time.sleep(max(0.0, 0.010 - (time.time() - t)))
        deadline = time.time() + 30
        while c.execute("SELECT count(*) FROM bench.pickup").fetchone()[0] < N_LATENCY and time.time() < deadline:
            time.sleep(0.05)
        ms = sorted(1000 * (s - t) for t, s in c.execute("SELECT sent, started FROM bench.pickup").fetchall())
    pct = lambda p: ms[min(len(ms) - 1, int(round(p / 100 * len(ms) + 0.5)) - 1)]
    return pct(50), pct(95), pct(99), ms[-1]


def external(pg, batch, n):
    with pg.connect() as c:
        for _ in range(n // 1000):
            c.execute("SELECT flow.enqueue_many('external_noop', array_fill('{}'::jsonb, array[1000]))")
    done = 0
    with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres", autocommit=True) as c:
        t0 = time.perf_counter()
        while True:
            claimed = c.execute("SELECT command_id, lease_token FROM flow.claim(array['external_noop'], 'bench', %s)",
                                (batch,)).fetchall()
            if not claimed:
                break
            if batch == 1:
                c.execute("SELECT flow.complete(%s, %s)", claimed[0])
            else:
                c.execute("SELECT count(*) FROM flow.complete_many(%s, %s)",
                          ([r[0] for r in claimed], [r[1] for r in claimed]))
            done += len(claimed)
        elapsed = time.perf_counter() - t0
    assert done == n, done
    with pg.connect() as c:
        c.execute("TRUNCATE flow._runs CASCADE")
    return n / elapsed


def peers():
    path = PEERS / "results" / "latest" / "results.jsonl"
    if not path.exists():
        path = PEERS / "results" / "20261202-092628" / "results.jsonl"
    by_peer = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        by_peer.setdefault(r.get("peer"), []).append(r)
    out = {}
    for peer, runs in by_peer.items():
        drains = [r["drain_rate"] for r in runs if r.get("workload") == "drain" and r.get("drain_rate")]
        p50 = [r["p50_ms"] for r in runs if r.get("workload") == "latency" and r.get("p50_ms") is not None]
        p99 = [r["p99_ms"] for r in runs if r.get("workload") == "latency" and r.get("p99_ms") is not None]
        out[peer] = (statistics.median(drains) if drains else None, statistics.median(p50) if p50 else None,
                     statistics.median(p99) if p99 else None)
    return out


def main():
    print(f"flow benchmark, {time.strftime('%Y-%m-%d %H:%M')}, loadavg {open('/proc/loadavg').read().split()[:3]}")
    known = peers()
    best_peer = max(((p, v[0]) for p, v in known.items() if v[0] and p and not p.startswith("floor")
                     and "pgq" not in p.lower()), key=lambda x: x[1], default=(None, None))
    results = {}
    for workers in (2, 4):
        pg = start(workers)
        try:
            print(f"-- {workers} workers")
            if workers == 2:
                bench_enqueue(pg)
            for handler in ("rust_noop", "plpgsql_noop"):
                rate, spread = repeated(lambda: drain(pg, handler))
                results[(handler, workers)] = rate
                ratio = f"x{rate / best_peer[1]:.2f} vs {best_peer[0]}" if best_peer[1] else ""
                report(f"W1 drain {N_DRAIN:,} no-op runs, {handler}, {workers} workers", rate, "jobs/s", ratio,
                       spread)
            if workers == 2:
                # Tuned like the peers (they fetch up to 1,000 jobs per query).
                with pg.connect() as c:
                    c.execute("ALTER SYSTEM SET flow.batch_size = 500")
                    c.execute("SELECT pg_reload_conf()")
                time.sleep(0.5)
                rate, spread = repeated(lambda: drain(pg, "rust_noop"))
                ratio = f"x{rate / best_peer[1]:.2f} vs {best_peer[0]}" if best_peer[1] else ""
                report(f"W1 drain {N_DRAIN:,} no-op runs, rust_noop, 2 workers, batch 500", rate, "jobs/s", ratio,
                       spread)
                with pg.connect() as c:
                    c.execute("ALTER SYSTEM RESET flow.batch_size")
                    c.execute("SELECT pg_reload_conf()")
                time.sleep(0.5)
                for sessions in (1, 2):
                    rate, spread = repeated(lambda: floor(pg, sessions))
                    results[("floor", sessions)] = rate
                    report(f"plain-SQL floor (indb.sql, batch 100), {sessions} session(s)", rate, "jobs/s", "",
                           spread)
                report("  flow (flow.noop, 2 workers) / floor (2 sessions), x100",
                       100 * results[("rust_noop", 2)] / results[("floor", 2)], "%")
                p50, p95, p99, worst = pickup(pg)
                peer_p50 = [v[1] for p, v in known.items() if v[1] and p and "pgq" not in p.lower()]
                report("W2 pickup latency p50 (client before enqueue -> handler start)", p50, "ms",
                       f"best peer p50 {min(peer_p50):.1f} ms" if peer_p50 else "")
                report("W2 pickup latency p95", p95, "ms")
                report("W2 pickup latency p99", p99, "ms")
                report("W2 pickup latency max", worst, "ms")
                for batch, n in ((1, 3000), (100, 20000)):
                    how = "complete" if batch == 1 else "complete_many"
                    report(f"external worker, claim max {batch} + {how}, 1 client over TCP", external(pg, batch, n),
                           "cmds/s")
        finally:
            pg.stop()
    print("\npeers (../shared/peers/results, measured earlier): " +
          ", ".join(f"{p} W1 {v[0]:,.0f} jobs/s, W2 p50 {v[1]} ms" for p, v in sorted(known.items())
                    if p and v[0] and v[1] is not None))


if __name__ == "__main__":
    main()
