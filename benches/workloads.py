"""Real workloads (issue 49), measured in one sitting, graphile-worker
through ../shared/peers where it has the workload, rounds interleaved:

    bash tools/setup.sh && /var/tmp/flow-venv/bin/python benches/workloads.py [--rounds N]

Targets (ratios measured here):
  slow        2,000 commands of a 50 ms handler (pg_sleep), flow.workers = 8:
              >= 0.9x the ideal rate (workers / handler time = 160/s), and
              >= 1x graphile-worker at concurrency 8 with the same handler
              (run.sh slow); measured cold (a handler no worker has run) and
              right after the workers warmed up on fast work
  fan-out     one run of 200 children of 50 ms, 8 workers: >= 0.9x ideal; the
              root spawns them one flow.spawn at a time, and in one flow.spawn_many
  mixed       pickup p99 of a fast queue while a slow queue limited to
              workers - 1 is saturated: <= 2x its idle p99
  drains      the no-op drain >= 3x graphile-worker's and the writing handler
              >= 2x, of 20,000 and of 100,000 (2 workers, as bench.py)
It is a benchmark, not a test: CI runs none of it.
"""
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from bench import GRAPHILE_DRAIN, PEERS, drain, graphile, quiet  # noqa: E402

SLOW_MS = 50
SLOW_N = 2000
FAN_N = 200
WORKERS = 8
IDEAL = WORKERS / (SLOW_MS / 1000)


def start_slow_cluster():
    pg = bench.start(WORKERS)
    with pg.connect() as c:
        c.execute("""
            CREATE FUNCTION bench.fan(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                FOR i IN 1..(args->>'n')::int LOOP
                    PERFORM flow.spawn(args->>'child', '{}', key => 'c' || i);
                END LOOP;
                RETURN NULL;
            END $$;
            SELECT flow.define('fan', 'bench.fan(jsonb, flow.context)'::regprocedure, queue => 'fan');
            CREATE FUNCTION bench.fan_many(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM flow.spawn_many(args->>'child', array_fill('{}'::jsonb, array[(args->>'n')::int]),
                                        ARRAY(SELECT 'c' || i FROM generate_series(1, (args->>'n')::int) i));
                RETURN NULL;
            END $$;
            SELECT flow.define('fan_many', 'bench.fan_many(jsonb, flow.context)'::regprocedure, queue => 'fan');
            SELECT flow.set_queue('slowq', concurrency => %s);
        """ % (WORKERS - 1))
    return pg


_handlers = 0


def new_slow_handler(pg, queue="slow"):
    """A 50 ms handler no worker has run yet (a function of its own), defined in `queue`."""
    global _handlers
    _handlers += 1
    name = f"slow_{_handlers}"
    with pg.connect() as c:
        c.execute(f"CREATE FUNCTION bench.{name}(args jsonb) RETURNS void LANGUAGE sql"
                  f" AS $$ SELECT pg_sleep({SLOW_MS / 1000}) $$")
        c.execute(f"SELECT flow.define('{name}', 'bench.{name}'::regproc, queue => '{queue}')")
    return name


def wait_finished(c, before, n, timeout=600):
    deadline = time.time() + timeout
    while bench.finished_count(c) - before < n:
        if time.time() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.01)


def slow_drain(pg, warm):
    """SLOW_N commands of a new 50 ms handler, enqueued at once into idle
    workers (warmed up on fast work first, if `warm`); returns jobs/s."""
    name = new_slow_handler(pg)
    with pg.connect() as c:
        if warm:
            before = bench.finished_count(c)
            c.execute("SELECT flow.enqueue_many('rust_noop', array_fill('{}'::jsonb, array[4000]), queue => 'warm')")
            wait_finished(c, before, 4000)
        c.execute("CHECKPOINT")
        time.sleep(1.0)
        before = bench.finished_count(c)
        t0 = time.perf_counter()
        c.execute("SELECT flow.enqueue_many(%s, array_fill('{}'::jsonb, array[%s]))", (name, SLOW_N))
        wait_finished(c, before, SLOW_N)
        elapsed = time.perf_counter() - t0
        bench.clear_flow_tables(c)
    return SLOW_N / elapsed


def fan_out(pg, root="fan"):
    """One run of FAN_N children of a new 50 ms handler, spawned by a root
    that calls flow.spawn for each ('fan') or flow.spawn_many once
    ('fan_many'); returns children/s."""
    name = new_slow_handler(pg)
    with pg.connect() as c:
        c.execute("CHECKPOINT")
        time.sleep(1.0)
        t0 = time.perf_counter()
        run = c.execute("SELECT flow.enqueue(%s, jsonb_build_object('n', %s::int, 'child', %s::text))",
                        (root, FAN_N, name)).fetchone()[0]
        status = c.execute("SELECT status FROM flow.await(%s, '120 s')", (run,)).fetchone()[0]
        elapsed = time.perf_counter() - t0
        assert status == "succeeded", status
        bench.clear_flow_tables(c)
    return FAN_N / elapsed


def mixed(pg):
    """Pickup p99 of the fast 'pickup' queue alone, then while a slow queue
    limited to WORKERS - 1 is kept saturated; returns (idle p99, busy p99)."""
    idle = bench.pickup(pg)[1]
    name = new_slow_handler(pg, queue="slowq")
    stop = threading.Event()

    def keep_saturated():
        with pg.connect() as c:
            while not stop.is_set():
                due = c.execute("SELECT count(*) FROM flow._commands WHERE queue = 'slowq'"
                                " AND status IN ('pending', 'running')").fetchone()[0]
                if due < 4 * WORKERS:
                    c.execute("SELECT flow.enqueue_many(%s, array_fill('{}'::jsonb, array[%s]))",
                              (name, 8 * WORKERS))
                time.sleep(0.05)

    feeder = threading.Thread(target=keep_saturated)
    feeder.start()
    time.sleep(1.0)
    try:
        busy = bench.pickup(pg)[1]
    finally:
        stop.set()
        feeder.join()
        with pg.connect() as c:
            c.execute("SELECT flow.cancel(run_id) FROM flow.commands WHERE queue = 'slowq' AND finished_at IS NULL")
            bench.clear_flow_tables(c)
    return idle, busy


def graphile_slow(round_):
    env = dict(os.environ, GW_CONCURRENCY=str(WORKERS), SLOW_MS=str(SLOW_MS))
    done = subprocess.run([str(PEERS / "graphile-worker" / "run.sh"), "slow", str(round_), str(SLOW_N)],
                          capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        sys.exit(f"graphile-worker did not run:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])["drain_rate"]


def main():
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    print(f"flow workloads benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
          f"loadavg {open('/proc/loadavg').read().split()[:3]}, {rounds} interleaved round(s)", flush=True)
    subprocess.run([str(PEERS / "pg.sh"), "start"], check=True, capture_output=True)
    fig = {}

    def add(key, value):
        fig.setdefault(key, []).append(value)
        print(f"  {key:<52} {value:>12,.1f}", flush=True)

    for r in range(1, rounds + 1):
        print(f"-- round {r}", flush=True)
        pg = start_slow_cluster()
        try:
            quiet(pg)
            add("graphile slow, concurrency 8 (jobs/s)", graphile_slow(r))
            quiet(pg)
            add("flow slow, cold (jobs/s)", slow_drain(pg, warm=False))
            add("flow slow, after fast work (jobs/s)", slow_drain(pg, warm=True))
            add("flow fan-out, 200 flow.spawn (children/s)", fan_out(pg))
            add("flow fan-out, one flow.spawn_many (children/s)", fan_out(pg, "fan_many"))
            idle, busy = mixed(pg)
            add("flow pickup p99, idle (ms)", idle)
            add("flow pickup p99, slow queue saturated (ms)", busy)
        finally:
            pg.stop()
        pg = bench.start(2)
        try:
            for n in (20_000, 100_000):
                quiet(pg)
                add(f"graphile drain {n:,} (jobs/s)", graphile("drain", r, n)["drain_rate"])
                quiet(pg)
                add(f"flow drain flow.noop {n:,} (jobs/s)", drain(pg, "rust_noop", n))
                add(f"flow drain writing handler {n:,} (jobs/s)", drain(pg, "writing", n))
        finally:
            pg.stop()

    med = {k: statistics.median(v) for k, v in fig.items()}
    g_slow = med["graphile slow, concurrency 8 (jobs/s)"]
    rows = [
        ("slow cold vs ideal", med["flow slow, cold (jobs/s)"] / IDEAL, 0.9, ">="),
        ("slow cold vs graphile", med["flow slow, cold (jobs/s)"] / g_slow, 1.0, ">="),
        ("slow after fast work vs ideal", med["flow slow, after fast work (jobs/s)"] / IDEAL, 0.9, ">="),
        ("slow after fast work vs graphile", med["flow slow, after fast work (jobs/s)"] / g_slow, 1.0, ">="),
        ("fan-out by spawn vs ideal", med["flow fan-out, 200 flow.spawn (children/s)"] / IDEAL, 0.9, ">="),
        ("fan-out by spawn_many vs ideal", med["flow fan-out, one flow.spawn_many (children/s)"] / IDEAL, 0.9, ">="),
        ("mixed pickup p99 busy / idle", med["flow pickup p99, slow queue saturated (ms)"]
         / med["flow pickup p99, idle (ms)"], 2.0, "<="),
    ]
    for n in (20_000, 100_000):
        g = med[f"graphile drain {n:,} (jobs/s)"]
        rows.append((f"no-op drain {n:,} vs graphile", med[f"flow drain flow.noop {n:,} (jobs/s)"] / g, 3.0, ">="))
        rows.append((f"writing drain {n:,} vs graphile", med[f"flow drain writing handler {n:,} (jobs/s)"] / g,
                     2.0, ">="))
    # per round too: a target met only in some rounds is not met
    print("-- verdicts (medians of the rounds; each round's ratio in brackets)")
    for label, ratio, target, op in rows:
        ok = ratio >= target if op == ">=" else ratio <= target
        print(f"  {label:<40} {ratio:6.2f}x  target {op} {target}  {'met' if ok else 'NOT MET'}", flush=True)


if __name__ == "__main__":
    main()
