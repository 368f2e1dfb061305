"""Chaos: a mixed workflow workload (fan-outs whose children wait on events,
retries, cancels, handlers that write, limited and unlimited queues, two
owners) under random fault points of every kind, kill -9 of workers and of
client backends, and immediate and fast restarts. Then a ledger:
- every run is terminal;
- each success's effect is there exactly once, a failure's or a cancel's never;
- every attempt that started is counted (a start is logged outside the
  attempt's transaction, through dblink);
- no command is charged an attempt that never started beyond the one each
  crashed worker was in;
- pg_amcheck finds the tables and indexes sound.

CI runs the short version (about a minute). The long one (FLOW_CHAOS=long:
2,000 runs, 20 crash cycles) runs on demand:
    FLOW_CHAOS=long python -m pytest -q pg_test/test_chaos.py -s
and prints its figures."""
import os
import random
import signal
import subprocess
import threading
import time

import psycopg
import pytest

from conftest import PGBIN, app_cluster, poll

LONG = os.environ.get("FLOW_CHAOS") == "long"
RUNS = 2000 if LONG else 400
CYCLES = 20 if LONG else 6

CHAOS_APP = """
    CREATE EXTENSION dblink;
    DO $$ BEGIN CREATE ROLE alice LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
    GRANT USAGE ON SCHEMA app TO alice;
    GRANT ALL ON app.effects TO alice;
    -- every attempt's start, written outside its transaction (it stays if the attempt rolls back)
    CREATE TABLE app.starts (command_id uuid, attempt int, at timestamptz DEFAULT clock_timestamp());
    CREATE FUNCTION app.log_start(ctx flow.context) RETURNS void LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, public AS $$
    BEGIN
        PERFORM public.dblink_exec('dbname=postgres user=postgres host=' || current_setting('unix_socket_directories')
                                   || ' port=' || current_setting('port'),
                                   format('INSERT INTO app.starts VALUES (%L, %s)', ctx.command_id, ctx.attempt));
    END $$;
    GRANT EXECUTE ON FUNCTION app.log_start(flow.context) TO alice;

    -- a root: spawns args.n parts and a join waiting on their events; fails its first attempt if told
    CREATE FUNCTION app.chaos_root(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE
        waits flow.wait_spec[] := '{}';
    BEGIN
        PERFORM app.log_start(ctx);
        INSERT INTO app.effects (run_id, key, attempt, tag) VALUES (ctx.run_id, ctx.command_key, ctx.attempt, 'chaos');
        FOR i IN 1..(args->>'n')::int LOOP
            PERFORM flow.spawn(args->>'part', jsonb_build_object('i', i, 'sleep', args->'sleep'), key => 'part-' || i);
            waits := waits || flow.wait('chaos_done', ctx.run_id || '/' || i);
        END LOOP;
        PERFORM flow.spawn(args->>'join', '{}', key => 'join', waits => waits, within => '10 minutes');
        IF args ? 'flaky' AND ctx.attempt = 1 THEN RAISE EXCEPTION 'flaky root'; END IF;
        RETURN NULL;
    END $$;
    CREATE FUNCTION app.chaos_part(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM app.log_start(ctx);
        INSERT INTO app.effects (run_id, key, attempt, tag) VALUES (ctx.run_id, ctx.command_key, ctx.attempt, 'chaos');
        IF (args->>'sleep') IS NOT NULL THEN PERFORM pg_sleep((args->>'sleep')::float); END IF;
        PERFORM flow.emit('chaos_done', ctx.run_id || '/' || (args->>'i'), jsonb_build_object('i', args->'i'));
        RETURN NULL;
    END $$;
    CREATE FUNCTION app.chaos_join(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM app.log_start(ctx);
        INSERT INTO app.effects (run_id, key, attempt, tag) VALUES (ctx.run_id, ctx.command_key, ctx.attempt, 'chaos');
        RETURN jsonb_build_object('inputs', jsonb_array_length(ctx.inputs));
    END $$;
    ALTER FUNCTION app.chaos_root(jsonb, flow.context) OWNER TO alice;
    ALTER FUNCTION app.chaos_part(jsonb, flow.context) OWNER TO alice;
    ALTER FUNCTION app.chaos_join(jsonb, flow.context) OWNER TO alice;
    -- postgres's: the same handlers, its own definitions, in a limited queue
    CREATE FUNCTION app.chaos_root2(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql
        AS $$ SELECT app.chaos_root(args, ctx) $$;
    CREATE FUNCTION app.chaos_part2(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql
        AS $$ SELECT app.chaos_part(args, ctx) $$;
    CREATE FUNCTION app.chaos_join2(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql
        AS $$ SELECT app.chaos_join(args, ctx) $$;
"""

DEFINE = """
    SELECT flow.define(%s, %s::regprocedure, queue => %s, max_attempts => 50, backoff => '10 ms',
                       backoff_max => '200 ms')
"""

FAULTS = ["claim:error%3", "handler_start:error%3", "handler_return:error%3", "settle_success:error%3",
          "settle_failure:error%10", "before_settle:die%1", "handler_start:die%1", "settle_success:transient%5",
          "handler_return:stall%1", "claim:die%1", "settle_success:invalid%1"]


@pytest.fixture(scope="module")
def pg():
    cluster = app_cluster(CHAOS_APP, conf=("flow.workers = 3", "restart_after_crash = on",
                                           "flow.poll_interval = '200ms'"))
    yield cluster
    cluster.stop()


def define_chaos(pg):
    pg.one("SELECT flow.set_queue('chaos_limited', concurrency => 4)")
    for owner, suffix, queue in (("alice", "", "role:alice"), ("postgres", "2", "chaos_limited")):
        for kind in ("root", "part", "join"):
            pg.one(DEFINE, f"chaos_{kind}{suffix}", f"app.chaos_{kind}{suffix}(jsonb, flow.context)", queue,
                   user=owner)


def enqueue_workload(pg, rng, count):
    """`count` runs, half each owner's; a tenth flaky (the root fails once), a few parts slow."""
    runs = []
    with pg.connect() as c, pg.connect(user="alice") as a:
        for i in range(count):
            suffix, conn = ("", a) if i % 2 == 0 else ("2", c)
            args = {"n": rng.randint(1, 4), "part": f"chaos_part{suffix}", "join": f"chaos_join{suffix}"}
            if rng.random() < 0.1:
                args["flaky"] = True
            if rng.random() < 0.1:
                args["sleep"] = 0.2
            runs.append(conn.execute("SELECT flow.enqueue(%s, %s::jsonb)",
                                     (f"chaos_root{suffix}", psycopg.types.json.Jsonb(args))).fetchone()[0])
    return runs


def crash(pg, rng, kind):
    """One crash cycle of `kind`; returns how many worker processes it took down."""
    pids = poll(pg.worker_pids, what="a worker (one a fault took down restarts within a second)")
    if kind == "kill_worker":
        os.kill(rng.choice(pids), signal.SIGKILL)
        pg.wait_crash_restart(pids)
        return len(pids)   # (the postmaster restarts every backend)
    if kind == "kill_client":
        # a client backend killed mid-transaction: the server restarts too
        victim = pg.connect(autocommit=False)
        victim.execute("SELECT flow.enqueue('chaos_root2', '{\"n\": 1, \"part\": \"chaos_part2\","
                       " \"join\": \"chaos_join2\"}')")
        os.kill(victim.info.backend_pid, signal.SIGKILL)
        pg.wait_crash_restart(pids)
        try:
            victim.close()
        except psycopg.Error:
            pass
        return len(pids)
    if kind == "immediate":
        pg.pg_ctl("-m", "immediate", "-w", "-t", "60", "stop")
        pg.pg_ctl("-w", "-t", "60", "start")
    else:
        pg.pg_ctl("-m", "fast", "-w", "-t", "60", "restart")
    pg.wait_ready()
    return len(pids)


def amcheck(pg):
    out = subprocess.run(["sudo", "-u", "postgres", f"{PGBIN}/pg_amcheck", "-h", pg.dir, "-p", str(pg.port),
                          "-d", "postgres", "--schema=flow", "--schema=app", "--heapallindexed", "--install-missing"],
                         capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout + out.stderr


def test_chaos(pg):
    rng = random.Random(49)
    define_chaos(pg)
    # (in waves, one per crash cycle: the faults and crashes land on work in progress)
    runs = enqueue_workload(pg, rng, RUNS // CYCLES)
    # cancels from the side, all along
    cancelled = []
    stop = threading.Event()

    def cancel_some():
        while not stop.is_set():
            try:
                with pg.connect() as c:
                    while not stop.is_set():
                        run = rng.choice(runs[-50:])
                        if c.execute("SELECT flow.cancel(%s)", (run,)).fetchone()[0]:
                            cancelled.append(run)
                        time.sleep(rng.uniform(0.05, 0.3))   # (time itself: cancels at random moments)
            except psycopg.OperationalError:
                time.sleep(0.5)   # (the server is restarting)

    canceller = threading.Thread(target=cancel_some)
    canceller.start()
    kinds = ["kill_worker", "kill_client", "immediate", "fast"]
    taken_down = 0
    started = time.time()
    try:
        for cycle in range(CYCLES):
            faults = ", ".join(rng.sample(FAULTS, 3))
            pg.configure("flow.fault_points", faults)
            if cycle:
                runs += enqueue_workload(pg, rng, RUNS // CYCLES)
            time.sleep(rng.uniform(0.5, 2.0))   # (time itself: work under faults)
            taken_down += crash(pg, rng, kinds[cycle % len(kinds)])
    finally:
        stop.set()
        canceller.join(30)
        pg.configure("flow.fault_points")
    pg.wait_for("SELECT count(*) = 0 FROM flow.runs WHERE id = ANY (%s) AND status = 'running'", runs,
                timeout=600 if LONG else 120)
    took = time.time() - started

    # every run terminal; successes whole and exactly once; failures and cancels leave nothing
    status = dict(pg.all("SELECT status, count(*) FROM flow.runs WHERE id = ANY (%s) GROUP BY 1", runs))
    assert set(status) <= {"succeeded", "cancelled", "failed"}, status
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = ANY (%s) AND finished_at IS NULL", runs) == 0
    assert pg.one("""SELECT count(*) FROM flow.commands c WHERE c.run_id = ANY (%s) AND c.status = 'succeeded'
                     AND (SELECT count(*) FROM app.effects e WHERE e.run_id = c.run_id AND e.key = c.key) <> 1""",
                  runs) == 0
    assert pg.one("""SELECT count(*) FROM flow.commands c WHERE c.run_id = ANY (%s) AND c.status <> 'succeeded'
                     AND EXISTS (SELECT 1 FROM app.effects e WHERE e.run_id = c.run_id AND e.key = c.key)""",
                  runs) == 0
    # a succeeded run's join saw every part's event
    assert pg.one("""SELECT count(*) FROM flow.runs r JOIN flow.commands j ON j.run_id = r.id AND j.key = 'join'
                     WHERE r.id = ANY (%s) AND r.status = 'succeeded'
                       AND (j.result->>'inputs')::int <> (SELECT count(*) FROM flow.commands p
                                                          WHERE p.run_id = r.id AND p.key LIKE 'part-%%')""",
                  runs) == 0
    # every attempt that started is counted
    uncounted = pg.all("""SELECT c.id, c.key, c.status::text, c.attempts, s.attempt, c.stop_reason,
                                 (SELECT array_agg(a.outcome || ':' || a.attempt) FROM flow._attempts a
                                  WHERE a.command_id = c.id)
                          FROM app.starts s JOIN flow._commands c ON c.id = s.command_id
                          WHERE c.run_id = ANY (%s) AND s.attempt > c.attempts""", runs)
    assert uncounted == [], pg.log()[-6000:]
    # charged, never started: at most the attempt each crashed worker was in (and each
    # fault that took a worker down: 'die' points, at most one attempt each)
    charged_unstarted = pg.one("""
        SELECT count(*) FROM flow.attempts a
        WHERE a.run_id = ANY (%s) AND a.outcome IN ('interrupted', 'lease_lost')
          AND NOT EXISTS (SELECT 1 FROM app.starts s WHERE s.command_id = a.command_id AND s.attempt = a.attempt)""",
                               runs)
    deaths = pg.log().count("exited with exit code 1") + pg.log().count("was terminated by signal 9")
    assert charged_unstarted <= taken_down + deaths, (charged_unstarted, taken_down, deaths)
    code, report = amcheck(pg)
    assert code == 0, report
    faults = pg.log().count("fault injected at")
    # (the faults did land: how many depends on where the crashes fall)
    assert faults > 0, faults
    outcomes = dict(pg.all("SELECT outcome, count(*) FROM flow.attempts WHERE run_id = ANY (%s) GROUP BY 1", runs))
    print(f"\nchaos: {len(runs)} runs {status}, {CYCLES} crash cycles ({taken_down} worker processes taken down,"
          f" {deaths} worker exits), {faults} faults injected, {len(cancelled)} cancels, attempts {outcomes},"
          f" {charged_unstarted} attempts charged that had not started, {took:.0f} s")
