"""Crash, shutdown and fault tests: workers die at random moments (under
plain commands and under workflows) and the engine still commits every
handler's effects exactly once; a handler that kills its own backend, or a
fault between handler and settlement, is counted and commits nothing."""
import os
import random
import signal
import time

import psycopg
import pytest

from conftest import assert_fan_outs_ran_once, ENGINE_APP, WORKFLOW_APP, app_cluster, attempts, define, enqueue, unique


@pytest.fixture(scope="module")
def pg():
    """app.effect (records each attempt, sleeps when told), the engine's
    handlers and the workflows' definitions ('fan_root', ...)."""
    cluster = app_cluster(ENGINE_APP, WORKFLOW_APP, """
        CREATE FUNCTION app.effect(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO app.effects (run_id, attempt) VALUES (ctx.run_id, ctx.attempt);
            IF (args->>'sleep') IS NOT NULL AND ctx.attempt <= coalesce((args->>'sleep_attempts')::int, 1000) THEN
                PERFORM pg_sleep((args->>'sleep')::float);
            END IF;
            RETURN jsonb_build_object('attempt', ctx.attempt);
        END $$;
    """, conf=("flow.workers = 2", "flow.batch_size = 10", "restart_after_crash = on"))
    yield cluster
    cluster.stop()


def settled(pg, runs):
    return pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY(%s) AND status <> 'running'", runs)


def assert_exactly_once(pg, runs):
    rows = pg.all("""
        SELECT r.status, count(e.run_id)
        FROM flow.runs r LEFT JOIN app.effects e ON e.run_id = r.id
        WHERE r.id = ANY(%s) GROUP BY r.id, r.status""", runs)
    assert len(rows) == len(runs)
    for status, effects in rows:
        assert status in ("succeeded", "failed"), status
        assert effects == (1 if status == "succeeded" else 0), (status, effects)
    # every command ended in exactly one terminal state, with one attempt row per attempt
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = ANY(%s) AND finished_at IS NULL", runs) == 0
    assert pg.one("""SELECT count(*) FROM flow.commands c WHERE c.run_id = ANY(%s)
                     AND c.attempts <> (SELECT count(*) FROM flow.attempts a WHERE a.command_id = c.id)""", runs) == 0


# ---------------------------------------------------------------- workers killed

def test_exactly_once_with_workers_killed_at_random(pg):
    name = define(pg, "app.effect", max_attempts=30, backoff="'10 ms'", backoff_max="'100 ms'")
    runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('sleep', 0.03)))"
                  " FROM generate_series(1, 400)")
    rng = random.Random(7)
    kills = {"terminate": 0, "sigkill": 0}
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            if settled(pg, runs) == len(runs):
                break
            pids = pg.worker_pids()
            if pids and kills["terminate"] + kills["sigkill"] < 20:
                pid = rng.choice(pids)
                if kills["terminate"] in (4, 12) and kills["sigkill"] < kills["terminate"] // 4:
                    os.kill(pid, signal.SIGKILL)  # the postmaster restarts the whole server
                    kills["sigkill"] += 1
                    pg.wait_crash_restart(pids)
                else:
                    pg.all("SELECT pg_terminate_backend(%s)", pid)
                    kills["terminate"] += 1
            time.sleep(rng.uniform(0.05, 0.3))   # (time itself: kills at random moments)
        except (psycopg.OperationalError, ProcessLookupError):
            pg.wait_ready()
    assert kills["terminate"] >= 3 and kills["sigkill"] >= 1, kills
    pg.wait_for("SELECT count(*) = %s FROM flow.runs WHERE id = ANY(%s) AND status <> 'running'",
                len(runs), runs, timeout=120)
    assert_exactly_once(pg, runs)
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY(%s) AND status = 'succeeded'", runs) == len(runs)
    interrupted = pg.one("SELECT count(*) FROM flow.attempts WHERE run_id = ANY(%s) AND outcome = 'interrupted'", runs)
    assert interrupted >= 1


def test_workers_killed_during_concurrent_workflows_lose_nothing(pg):
    runs = pg.one("SELECT flow.enqueue_many('fan_root', array_fill('{\"n\": 20}'::jsonb, array[100]))")
    rng = random.Random(11)
    kills = 0
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            if pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY(%s) AND status = 'running'", runs) == 0:
                break
            pids = pg.worker_pids()
            if pids and kills < 3:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills += 1
                pg.wait_crash_restart(pids)
            time.sleep(rng.uniform(0.3, 1.0))   # (time itself: kills at random moments)
        except (psycopg.OperationalError, ProcessLookupError):
            pg.wait_ready()
    assert kills >= 1
    pg.wait_for("SELECT count(*) = 0 FROM flow.runs WHERE id = ANY(%s) AND status = 'running'", runs, timeout=240)
    assert_fan_outs_ran_once(pg, runs, 20)
    # no event lost: every join saw all 20 inputs without timing out
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = ANY(%s) AND key = 'join'"
                  " AND result->>'timed_out' = 'false'", runs) == 100


def test_workers_come_back_after_a_crash(pg):
    before = pg.worker_pids()
    os.kill(before[0], signal.SIGKILL)
    pg.wait_crash_restart(before)
    pg.wait_for("SELECT count(*) = 2 FROM pg_stat_activity WHERE backend_type = 'flow worker'")
    name = define(pg, "app.effect")
    assert pg.await_run(pg.one(f"SELECT flow.enqueue('{name}')"), "20s")[0] == "succeeded"


def test_a_handler_that_kills_its_backend_stops_at_the_attempt_limit(app):
    name = define(app, "app.decides", max_attempts=2, backoff="'10 ms'")
    run = enqueue(app, name, '{"do": "die"}')
    status, _, error = app.await_run(run, "30s")
    assert status == "failed" and error["stop_reason"] == "attempt_limit"
    rows = attempts(app, run)
    assert [(r[1], r[2]) for r in rows] == [("interrupted", "owner_died")] * 2
    app.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")


def test_a_held_attempt_that_takes_its_worker_down_is_counted(pg):
    """A handler the workers know to be fast has its commands held: run and
    settled in the claim's transaction. One that takes its worker down on
    some arguments still has each such attempt counted, through the worker's
    record of the held attempt it was in, and reaches its attempt limit; the
    commands that shared its transaction run again uncharged."""
    pg.all("""CREATE OR REPLACE FUNCTION app.maybe_die(args jsonb, ctx flow.context) RETURNS jsonb
              LANGUAGE plpgsql AS $$
              BEGIN
                  INSERT INTO app.effects VALUES (ctx.run_id, ctx.attempt);
                  IF args ? 'die' THEN
                      PERFORM pg_terminate_backend(pg_backend_pid());
                      PERFORM pg_sleep(5);
                  END IF;
                  RETURN jsonb_build_object('attempt', ctx.attempt);
              END $$""")
    name = unique("held")
    pg.one(f"SELECT flow.define('{name}', 'app.maybe_die'::regproc, max_attempts => 3, backoff => '10 ms')")
    # every worker learns that the handler is fast
    for _ in range(10):
        runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[20]))")
        for run in runs:
            assert pg.await_run(run, "30s")[0] == "succeeded"
    log_before = len(pg.log())
    pg.one("SELECT flow.set_queue('default', paused => true)")
    poison = pg.one(f"SELECT flow.enqueue('{name}', '{{\"die\": true}}')")
    good = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[40]))")
    pg.one("SELECT flow.set_queue('default', paused => false)")
    status, _, error = pg.await_run(poison, "60s")
    assert status == "failed" and error["stop_reason"] == "attempt_limit"
    assert pg.all("SELECT attempt, outcome FROM flow.attempts WHERE run_id = %s ORDER BY attempt", poison) == \
        [(1, "interrupted"), (2, "interrupted"), (3, "interrupted")]
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s", poison) == 0
    for run in good:
        assert pg.await_run(run, "30s")[0] == "succeeded"
    assert_exactly_once(pg, good)
    assert pg.one("SELECT max(attempts) FROM flow.commands WHERE run_id = ANY(%s)", good) == 1
    # the first attempt was held, and concluded from its worker's record
    assert "as interrupted: its worker stopped in it" in pg.log()[log_before:]
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")


# ---------------------------------------------------------------- shutdowns

def test_fast_shutdown_during_a_handler_then_retry(pg):
    name = define(pg, "app.effect", max_attempts=5, backoff="'10 ms'")
    run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"sleep\": 30, \"sleep_attempts\": 1}}')")
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    pg.wait_handler_sleeping(run)
    t0 = time.time()
    pg.pg_ctl("-m", "fast", "-w", "-t", "60", "stop")
    stopped_in = time.time() - t0
    assert stopped_in < 5, stopped_in
    pg.pg_ctl("-w", "-t", "60", "start")
    pg.wait_ready()
    status, result, _ = pg.await_run(run, "30s")
    assert status == "succeeded" and result == {"attempt": 2}
    assert pg.all("SELECT attempt, outcome, error_code FROM flow.attempts WHERE run_id = %s ORDER BY attempt",
                  run) == [(1, "interrupted", "owner_died"), (2, "succeeded", None)]
    assert pg.all("SELECT attempt FROM app.effects WHERE run_id = %s", run) == [(2,)]


def test_immediate_shutdown_during_a_handler_then_retry(pg):
    name = define(pg, "app.effect", max_attempts=5, backoff="'10 ms'")
    run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"sleep\": 30, \"sleep_attempts\": 1}}')")
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    pg.pg_ctl("-m", "immediate", "-w", "-t", "60", "stop")
    pg.pg_ctl("-w", "-t", "60", "start")
    pg.wait_ready()
    assert pg.await_run(run, "30s")[:2] == ("succeeded", {"attempt": 2})
    assert pg.all("SELECT attempt FROM app.effects WHERE run_id = %s", run) == [(2,)]


# ---------------------------------------------------------------- faults

def test_death_between_handler_and_settlement_commits_nothing(pg):
    name = define(pg, "app.effect", max_attempts=2, backoff="'10 ms'")
    pg.configure("flow.fault_points", "before_settle", settle=0.5)
    try:
        run = pg.one(f"SELECT flow.enqueue('{name}')")
        status, _, error = pg.await_run(run, "30s")
    finally:
        pg.configure("flow.fault_points")
    assert status == "failed" and error["stop_reason"] == "attempt_limit"
    assert pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s ORDER BY attempt", run) == \
        [("interrupted",), ("interrupted",)]
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s", run) == 0
