"""The in-database engine: workers claim, execute, classify, retry and
settle; fairness across queues, wake-up, what the views show, and the rows a
run gets. (Cancel: test_cancel.py; pruning: test_retention.py.)"""
import json
import time

import psycopg
import pytest

from conftest import (ACT, ACT_APP, ENGINE_APP, app_cluster, attempts, command, define, effects, enqueue, root,
                      seen_fast, unique)


@pytest.fixture(scope="module")
def pg():
    """The engine's handlers (app.hello, app.decides, ...) and app.act."""
    cluster = app_cluster(ENGINE_APP, ACT_APP)
    yield cluster
    cluster.stop()


# ---------------------------------------------------------------- end to end

def test_plpgsql_handler_end_to_end(app):
    name = define(app, "app.hello")
    run = enqueue(app, name, '{"who": "world"}')
    status, result, error = app.await_run(run, "10s")
    assert status == "succeeded" and error is None
    assert result["hello"] == "world"
    # (its owner, postgres, sets none: "$user" alone, never a schema another role may write)
    assert result["search_path"] == '"$user"'
    assert command(app, run)[:2] == ("succeeded", 1)
    assert [a[1] for a in attempts(app, run)] == ["succeeded"]


def test_rust_handlers_end_to_end(app):
    noop = define(app, "flow.noop")
    assert app.await_run(enqueue(app, noop), "10s") == ("succeeded", None, None)
    sql = define(app, "flow.run_sql")
    run = app.one(f"SELECT flow.enqueue('{sql}', jsonb_build_object('sql',"
                  " 'INSERT INTO app.effects (run_key) VALUES (''from_run_sql'')'))")
    assert app.await_run(run, "10s") == ("succeeded", {"rows": 1}, None)
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'from_run_sql'") == 1


def test_a_replaced_handler_runs_its_new_body_whatever_its_language(app):
    # PL/pgSQL and C handlers are called through fmgr with a call info each
    # worker keeps; replacing the function must reach every worker's next call
    app.all("""CREATE FUNCTION app.morph(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
               BEGIN RETURN jsonb_build_object('v', 1); END $$""")
    name = define(app, "app.morph")

    def results():
        runs = [enqueue(app, name) for _ in range(6)]
        return [app.await_run(run, "10s") for run in runs]

    assert results() == [("succeeded", {"v": 1}, None)] * 6
    app.all("""CREATE OR REPLACE FUNCTION app.morph(args jsonb) RETURNS jsonb LANGUAGE sql
               AS $$ SELECT jsonb_build_object('v', 2) $$""")
    assert results() == [("succeeded", {"v": 2}, None)] * 6
    # a STABLE handler reads through the snapshot the worker gives it
    app.all("INSERT INTO app.effects (run_key) VALUES ('morph')")
    app.all("""CREATE OR REPLACE FUNCTION app.morph(args jsonb) RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
               BEGIN RETURN jsonb_build_object('v', 3, 'seen',
                   (SELECT count(*) FROM app.effects WHERE run_key = 'morph')); END $$""")
    assert results() == [("succeeded", {"v": 3, "seen": 1}, None)] * 6

def test_a_void_sql_handler_runs_its_body_once_and_then_its_replacement(app):
    # A void LANGUAGE sql handler is called in the select list, where its
    # body is inlined into the worker's kept plan: the plan must still run it
    # once a command, follow its replacement, and a body of two statements
    # (not inlined) must run as well
    app.all("""CREATE FUNCTION app.void_sql(args jsonb) RETURNS void LANGUAGE sql AS $$
               INSERT INTO app.effects (run_key) VALUES ('void v1 ' || (args->>'i')) $$""")
    name = define(app, "app.void_sql")

    def run_all(tag):
        runs = [enqueue(app, name, f'{{"i": "{tag}{i}"}}') for i in range(6)]
        assert [app.await_run(run, "10s") for run in runs] == [("succeeded", None, None)] * 6

    run_all("a")
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key LIKE 'void v1 a%'") == 6
    app.all("""CREATE OR REPLACE FUNCTION app.void_sql(args jsonb) RETURNS void LANGUAGE sql AS $$
               SELECT pg_catalog.set_config('app.unused', 'x', true);
               INSERT INTO app.effects (run_key) VALUES ('void v2 ' || (args->>'i')) $$""")
    run_all("b")
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key LIKE 'void v2 b%'") == 6
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key LIKE 'void v1 b%'") == 0
    app.all("""CREATE OR REPLACE FUNCTION app.void_sql(args jsonb) RETURNS void LANGUAGE sql AS $$
               SELECT pg_catalog.pg_sleep(0) $$""")
    run_all("c")
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key LIKE 'void%'") == 12


def test_a_writing_sql_handler_called_directly_writes_once_beside_a_failing_attempt(app):
    # A LANGUAGE sql handler whose body cannot be inlined is called through
    # fmgr, and held attempts share a subtransaction in groups: one attempt's
    # failure rolls its group back, the others run again, and each writes once
    app.all("""CREATE TABLE app.once (k text PRIMARY KEY);
               INSERT INTO app.once VALUES ('k17');
               CREATE FUNCTION app.write_once(args jsonb) RETURNS jsonb LANGUAGE sql AS $$
                   INSERT INTO app.once VALUES (args->>'k');
                   SELECT jsonb_build_object('k', k) FROM app.once WHERE k = args->>'k' $$""")
    name = define(app, "app.write_once", max_attempts="1")
    enqueue(app, name, '{"k": "warm"}')   # (its first attempt is leased; those after it held)
    app.wait_for("SELECT count(*) = 1 FROM app.once WHERE k = 'warm'")
    runs = app.one("SELECT flow.enqueue_many(%s, ARRAY(SELECT jsonb_build_object('k', 'k' || i)"
                   " FROM generate_series(0, 39) i))", name)
    outcomes = [app.await_run(run, "20s") for run in runs]
    assert outcomes[17][0] == "failed"
    assert attempts(app, runs[17])[-1][2] == "23505"
    assert [o for i, o in enumerate(outcomes) if i != 17] == \
        [("succeeded", {"k": f"k{i}"}, None) for i in range(40) if i != 17]
    assert app.one("SELECT count(*) FROM app.once") == 41



def test_run_sql_without_sql_fails_permanently(app):
    sql = define(app, "flow.run_sql")
    run = enqueue(app, sql, '{"nope": 1}')
    assert app.await_run(run, "10s")[0] == "failed"
    assert command(app, run)[:4] == ("failed", 1, "permanent", "permanent")


def test_the_context_tells_the_enforced_deadline_and_the_times(pg):
    pg.all("""CREATE FUNCTION app.ctx(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql AS $$
              SELECT jsonb_build_object('deadline_ms', extract(epoch FROM ctx.deadline - ctx.attempt_started_at) * 1000,
                                        'started_late', ctx.attempt_started_at >= ctx.created_at,
                                        'budget', ctx.budget_started_at IS NOT NULL,
                                        'now_after_start', clock_timestamp() >= ctx.attempt_started_at) $$""")
    name = unique("ctx")
    pg.one(f"SELECT flow.define('{name}', 'app.ctx(jsonb, flow.context)'::regprocedure, timeout => '2 s')")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    status, result, _ = pg.await_run(run)
    assert status == "succeeded"
    # the deadline is the one enforced: the handler's start plus its timeout
    assert abs(float(result["deadline_ms"]) - 2000) < 5
    assert result["started_late"] and result["budget"] and result["now_after_start"]


def test_args_and_results_pass_through_exactly(app):
    """Args reach the handler and its result reaches the run as the jsonb they
    were: numbers beyond a double (digits, trailing zeros), unicode, and a
    value large enough to be stored compressed, through each way a handler is
    called (PL/pgSQL directly, SQL and context handlers through SPI)."""
    app.all("""
        CREATE FUNCTION app.echo_plpgsql(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$ BEGIN RETURN args; END $$;
        CREATE FUNCTION app.echo_sql(args jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT args $$;
        CREATE FUNCTION app.echo_args_context(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql AS $$ SELECT args $$;
    """)
    args = ('{"big": 123456789012345678901234567890.000001000, "price": 1.10, "tiny": 1e-20, "neg": -0.0,'
            ' "text": "d\u00e9j\u00e0 vu \u2603", "nested": {"list": [1, 2.50, null, true]},'
            ' "blob": "' + "0123456789abcdef" * 400 + '"}')
    for handler in ("app.echo_plpgsql", "app.echo_sql", "app.echo_args_context"):
        name = define(app, handler)
        run = app.one("SELECT flow.enqueue(%s, %s::jsonb)", name, args)
        assert app.await_run(run, "10s")[0] == "succeeded"
        assert app.one("SELECT r.result::text = %s::jsonb::text AND c.result::text = %s::jsonb::text"
                       " FROM flow.runs r JOIN flow.commands c ON c.id = r.id WHERE r.id = %s", args, args, run), handler


# ---------------------------------------------------------------- classification and retry

def test_retries_until_attempt_limit_with_backoff(app):
    name = define(app, "app.always_fails", max_attempts=4, backoff="'200 ms'", backoff_max="'2 s'")
    run = enqueue(app, name, '{"tag": "backoff"}')
    status, _, error = app.await_run(run, "20s")
    assert status == "failed" and error["stop_reason"] == "attempt_limit" and error["code"] == "22012"
    rows = attempts(app, run)
    assert [r[1] for r in rows] == ["retryable"] * 4
    assert all(r[2] == "22012" and r[3] == "division by zero" for r in rows)
    gaps = [(b[4] - a[4]).total_seconds() for a, b in zip(rows, rows[1:])]
    # backoff 200 ms doubling, jittered by ±25 %: ≥150, ≥300, ≥600 ms
    assert gaps[0] >= 0.15 and gaps[1] >= 0.3 and gaps[2] >= 0.6, gaps
    assert gaps[0] < 1.0 and gaps[1] < 1.5, gaps
    assert command(app, run)[:3] == ("failed", 4, "attempt_limit")
    # the failed attempts' writes rolled back with them
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'backoff'") == 0


def test_retries_at_the_cap_are_spread_below_it(app):
    """Retries whose backoff reached backoff_max are jittered within [75 %,
    100 %] of it, not all put at backoff_max itself (0.2.0 clamped after
    the jitter: every one of them landed on the cap at once)."""
    delays = [r[0] for r in app.all("SELECT extract(epoch FROM flow._backoff('1 s', '10 s', 30))::float8"
                                      " FROM generate_series(1, 200)")]
    assert all(7.5 <= d <= 10.0 for d in delays), (min(delays), max(delays))
    assert len({round(d, 3) for d in delays}) > 50
    assert sum(d < 9.9 for d in delays) > 100
    # and below the cap, as before: [backoff, backoff_max], ±25 % around the doubling
    low = [r[0] for r in app.all("SELECT extract(epoch FROM flow._backoff('1 s', '10 s', 2))::float8"
                                   " FROM generate_series(1, 200)")]
    assert all(1.5 <= d <= 2.5 for d in low)


def test_a_handlers_own_sqlstate_is_recorded(app):
    """A handler's RAISE ... USING ERRCODE = 'AB123' is recorded with its own
    code, class retryable (0.2.0: XX000, class crash, as pgrx maps a code it
    does not know)."""
    app.all("CREATE OR REPLACE FUNCTION app.own_code(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'out of widgets' USING ERRCODE = 'AB123'; END $$")
    name = define(app, "app.own_code", max_attempts=2, backoff="'10 ms'")
    run = enqueue(app, name)
    status, _, error = app.await_run(run, "10s")
    assert status == "failed" and error["code"] == "AB123" and error["stop_reason"] == "attempt_limit"
    assert [r[1:4] for r in attempts(app, run)] == [("retryable", "AB123", "out of widgets")] * 2
    # a code PostgreSQL knows is kept as before
    app.all("CREATE OR REPLACE FUNCTION app.known_code(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'taken' USING ERRCODE = 'unique_violation'; END $$")
    run = enqueue(app, define(app, "app.known_code", max_attempts=1))
    assert app.await_run(run, "10s")[2]["code"] == "23505"


def test_elapsed_limit(app):
    name = define(app, "app.always_fails", max_attempts=10, backoff="'1 s'", max_elapsed="'500 ms'")
    run = enqueue(app, name)
    assert app.await_run(run, "10s")[0] == "failed"
    assert command(app, run)[:3] == ("failed", 1, "elapsed_limit")


def test_deadline_before_next_attempt(app):
    name = define(app, "app.always_fails", max_attempts=10, backoff="'1 s'")
    run = enqueue(app, name, deadline="'800 ms'")
    assert app.await_run(run, "10s")[0] == "failed"
    assert command(app, run)[:3] == ("failed", 1, "deadline_before_next_attempt")


def test_flow_fail_is_permanent(app):
    name = define(app, "app.decides")
    run = enqueue(app, name, '{"do": "fail", "tag": "perm"}')
    status, _, error = app.await_run(run, "10s")
    assert status == "failed" and error["message"] == "card declined"
    assert command(app, run) == ("failed", 1, "permanent", "permanent", "card declined")
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'perm'") == 0


def test_a_caught_flow_fail_does_not_make_a_later_error_permanent(app):
    name = define(app, "app.decides", max_attempts=2, backoff="'10 ms'")
    run = enqueue(app, name, '{"do": "catch_fail"}')
    assert app.await_run(run, "10s")[0] == "failed"
    assert command(app, run)[:3] == ("failed", 2, "attempt_limit")


def test_retry_after(app):
    name = define(app, "app.decides", backoff="'1 hour'", backoff_max="'2 hours'")
    run = enqueue(app, name, '{"do": "retry_after", "tag": "ra"}')
    status, result, _ = app.await_run(run, "10s")
    assert status == "succeeded" and result["attempt"] == 2
    rows = attempts(app, run)
    assert rows[0][1:4] == ("retry_after", "retry_after", "rate limited")
    assert rows[1][1] == "succeeded"
    gap = (rows[1][4] - rows[0][4]).total_seconds()
    assert 0.4 <= gap < 2.0, gap
    # only the successful attempt's write committed
    assert app.all("SELECT attempt FROM app.effects WHERE run_key = 'ra'") == [(2,)]


def test_retry_after_needs_a_positive_delay(app):
    name = define(app, "app.decides")
    run = enqueue(app, name, '{"do": "bad_retry"}')
    assert app.await_run(run, "10s")[0] == "failed"
    assert command(app, run)[:4] == ("failed", 1, "permanent", "invalid_retry_after")


def test_retry_after_above_backoff_max_is_honoured(pg):
    pg.all("CREATE FUNCTION app.later(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS"
           " $$ BEGIN IF ctx.attempt = 1 THEN PERFORM flow.retry_after('1500 ms'); END IF;"
           " RETURN jsonb_build_object('attempt', ctx.attempt); END $$")
    name = unique("later")
    pg.one(f"SELECT flow.define('{name}', 'app.later(jsonb, flow.context)'::regprocedure, backoff => '100 ms',"
           " backoff_max => '200 ms')")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    assert pg.await_run(run, "10s")[0] == "succeeded"
    started = [r[0] for r in pg.all("SELECT started_at FROM flow.attempts WHERE run_id = %s ORDER BY attempt", run)]
    assert (started[1] - started[0]).total_seconds() >= 1.4


def test_timeout(app):
    name = define(app, "app.decides", timeout="'300 ms'", max_attempts=2, backoff="'10 ms'")
    t0 = time.time()
    run = enqueue(app, name, '{"do": "sleep", "seconds": 10}')
    status, _, error = app.await_run(run, "20s")
    assert status == "failed" and error["stop_reason"] == "attempt_limit"
    assert time.time() - t0 < 5
    # (the first attempt of a handler other tests made fast is cut at its
    # 100 ms budget and voided: counted, not charged)
    rows = [r for r in attempts(app, run) if r[1] != "voided"]
    assert [r[1] for r in rows] == ["timeout", "timeout"]
    assert all(r[2] == "attempt_timeout" for r in rows)
    durations = app.all("SELECT extract(epoch FROM duration) FROM flow.attempts WHERE run_id = %s"
                        " AND outcome <> 'voided'", run)
    assert all(0.25 <= float(d[0]) < 1.5 for d in durations), durations


def test_the_timeout_counts_from_the_handlers_start_not_the_claim(app):
    # 8 handlers of 0.3 s claimed together (batch 100) by one worker or two:
    # the later ones start over a second after their claim, within their timeout.
    name = define(app, "app.decides", timeout="'1 s'", max_attempts=1)
    runs = app.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{\"do\": \"sleep\", \"seconds\": 0.3}}'::jsonb,"
                   " array[8]))")
    for run in runs:
        assert app.await_run(run, "20s")[0] == "succeeded"
    assert app.one("SELECT count(*) FROM flow.attempts WHERE run_id = ANY(%s) AND outcome = 'succeeded'", runs) == 8


def test_a_burst_of_slow_commands_is_shared_by_the_workers(app):
    app.all("CREATE FUNCTION app.slow(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$"
            " BEGIN PERFORM pg_sleep(0.15); RETURN jsonb_build_object('pid', pg_backend_pid()); END $$")
    name = define(app, "app.slow")
    # warm up: the workers learn that this work is slow
    for run in app.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[4]))"):
        app.await_run(run, "20s")
    t0 = time.time()
    runs = app.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[20]))")
    pids = {app.await_run(run, "30s")[1]["pid"] for run in runs}
    elapsed = time.time() - t0
    assert len(pids) == 2, pids      # both workers took part
    assert elapsed < 2.6, elapsed    # 20 x 0.15 s = 3 s on one worker


def test_the_run_deadline_bounds_the_attempt(app):
    name = define(app, "app.decides", max_attempts=3)
    run = enqueue(app, name, '{"do": "sleep", "seconds": 10}', deadline="'500 ms'")
    assert app.await_run(run, "10s")[0] == "failed"
    assert command(app, run)[:3] == ("failed", 1, "deadline_before_next_attempt")
    assert attempts(app, run)[0][1] == "timeout"


def test_result_too_large_is_permanent_and_rolls_back(app):
    name = define(app, "app.decides")
    run = enqueue(app, name, '{"do": "big", "tag": "big"}')
    assert app.await_run(run, "10s")[0] == "failed"
    assert command(app, run)[:4] == ("failed", 1, "permanent", "result_too_large")
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'big'") == 0


def test_a_caught_invalid_spawn_is_still_an_invalid_decision(pg):
    run = enqueue(pg, define(pg, ACT), '{"do": "bad_spawn"}')
    assert pg.await_run(run)[0] == "failed"
    assert root(pg, run)[2:] == ("permanent", "invalid_decision")


def test_a_caught_timeout_is_still_a_timeout(pg):
    run = enqueue(pg, define(pg, ACT, timeout="'300 ms'", max_attempts=1), '{"do": "swallow_timeout"}')
    assert pg.await_run(run)[0] == "failed"
    assert attempt_outcomes(pg, run) == ["timeout"]


def attempt_outcomes(pg, run):
    """A run's attempts' outcomes, but those the engine voided (an attempt of
    a handler known to be fast cut at its 100 ms budget, counted and not
    charged: test_workloads.py covers them)."""
    return [r[0] for r in pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s AND outcome <> 'voided'"
                                 " ORDER BY attempt", run)]


def test_a_deadline_already_past_when_the_handler_would_start(pg):
    # the first command holds the only slot of its queue past the second's run deadline
    q = unique("late")
    pg.one(f"SELECT flow.set_queue('{q}', concurrency => 1)")
    first = enqueue(pg, define(pg, ACT, queue=f"'{q}'"), '{"do": "sleep", "seconds": 1.5}')
    pg.wait_handler_sleeping(first)
    tag = unique("late")
    run = enqueue(pg, define(pg, ACT, queue=f"'{q}'", max_attempts=1), f'{{"tag": "{tag}"}}', deadline="'1 second'")
    status, _, error = pg.await_run(run, "10s")
    assert status == "failed"
    assert effects(pg, tag) == 0          # the handler never ran
    # ended at its deadline by the maintenance worker (flow._expire_runs), or
    # claimed first and refused before its handler started
    assert (error["stop_reason"], attempt_outcomes(pg, run)) in (("deadline", []), ("attempt_limit", ["timeout"]))


def test_pg_cancel_backend_interrupts_a_handler_and_it_is_retried(pg):
    tag = unique("pgcancel")
    run = enqueue(pg, define(pg, ACT, max_attempts=3, backoff="'10 ms'"),
                  f'{{"do": "sleep_first", "seconds": 5, "tag": "{tag}"}}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    pg.wait_handler_sleeping(run)
    pg.all("SELECT pg_cancel_backend(pid) FROM flow.workers WHERE command_id IS NOT NULL")
    assert pg.await_run(run, "10s")[0] == "succeeded"
    assert attempt_outcomes(pg, run) == ["interrupted", "succeeded"]


def test_a_long_multibyte_message_is_cut_at_1_kib_without_splitting_a_character(pg):
    pg.all("CREATE FUNCTION app.multibyte(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS"
           " $$ BEGIN RAISE EXCEPTION '%', repeat('é', 1000) || repeat('🙂', 100); END $$")
    name = unique("mb")
    pg.one(f"SELECT flow.define('{name}', 'app.multibyte'::regproc, max_attempts => 1)")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    assert pg.await_run(run, "10s")[0] == "failed"
    message = pg.one("SELECT last_error_message FROM flow._commands WHERE run_id = %s", run)
    assert 1000 < len(message.encode()) <= 1024
    assert message == ("é" * 1000)[:len(message)]


def test_a_rust_panic_in_a_handler_is_the_crash_class(pg):
    name = unique("panic")
    pg.one(f"SELECT flow.define('{name}', 'flow._test_panic'::regproc, max_attempts => 1)")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    assert pg.await_run(run, "10s")[0] == "failed"
    assert attempt_outcomes(pg, run) == ["crash"]
    assert pg.await_run(enqueue(pg, define(pg, ACT)), "10s")[0] == "succeeded"


def test_the_retry_budget_starts_when_the_command_is_first_due(pg):
    tag = unique("budget")
    child = define(pg, ACT, max_elapsed="'3 s'", backoff="'100 ms'", backoff_max="'100 ms'")
    run = enqueue(pg, define(pg, ACT), f'{{"do": "spawn_for_event", "child": "{child}", "tag": "{tag}"}}')
    pg.wait_for("SELECT status = 'waiting' FROM flow._commands WHERE run_id = %s AND key = 'child'", run)
    time.sleep(3.5)    # (time itself:) longer than max_elapsed: waiting must not use up the budget
    pg.one("SELECT flow.emit('go', %s)", tag)
    assert pg.await_run(run)[0] == "succeeded", pg.all(
        "SELECT key, status, attempts, stop_reason, last_error_code, last_error_message, budget_started_at, created_at"
        " FROM flow._commands WHERE run_id = %s", run)
    assert pg.one("SELECT attempts FROM flow._commands WHERE run_id = %s AND key = 'child'", run) == 2


def test_args_that_no_longer_fit_fail_permanently_before_the_handler(pg):
    pg.all("CREATE TYPE app.shrinking AS (a int, b text)")
    q = unique("typedq")
    name = unique("shrink")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, queue => '{q}', args_type => 'app.shrinking')")
    run = pg.one(f"""SELECT flow.enqueue('{name}', '{{"a": 1, "b": "gone"}}')""")
    pg.all("ALTER TYPE app.shrinking DROP ATTRIBUTE b")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)")
    assert pg.await_run(run)[0] == "failed"
    assert root(pg, run)[1:] == (1, "permanent", "argument_decode")


# ---------------------------------------------------------------- fairness and limits

def test_fairness_across_queues(app):
    name = define(app, "app.record")
    app.one("SELECT flow.set_queue('fa', paused => true)")
    app.one("SELECT flow.set_queue('fb', paused => true)")
    app.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('tag', 'fair', 'q', 'A')),"
            " queue => 'fa') FROM generate_series(1, 2000)")
    app.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('tag', 'fair', 'q', 'B')),"
            " queue => 'fb') FROM generate_series(1, 20)")
    # both queues open in one commit: opened one after the other, the workers
    # rightly drained A alone in between (about 1,000 of its runs in the few
    # ms between two connections' commits, once in CI)
    app.one("SELECT flow.set_queue('fa', paused => false), flow.set_queue('fb', paused => false)")
    app.wait_for("SELECT count(*) = 2020 FROM app.effects WHERE run_key = 'fair' AND q IN ('A', 'B')", timeout=120)
    a_before_b_done = app.one(
        "SELECT count(*) FROM app.effects WHERE run_key = 'fair' AND q = 'A'"
        " AND at <= (SELECT max(at) FROM app.effects WHERE run_key = 'fair' AND q = 'B')")
    # (failed once in CI, not reproduced since: the last B's attempts and the
    # workers' counters say what held it back, should it fail again)
    last_b = app.all("SELECT a.attempt, a.outcome, a.error_code, a.owner, a.started_at - r.created_at"
                     " FROM flow.attempts a JOIN flow.runs r ON r.id = a.run_id WHERE r.name = %s"
                     " AND r.args->>'q' = 'B' ORDER BY r.finished_at DESC, a.attempt LIMIT 3", name)
    assert a_before_b_done < 1000, (a_before_b_done, last_b, app.all("SELECT name, value FROM flow.stats"))


def test_a_claim_from_several_queues_locks_only_what_it_claims(app):
    # A row the claim locked and left out stays locked for its transaction (a
    # held chunk's whole run): the other workers' claims skip it and take up
    # after it, and it waited a second while its queue's later commands ran.
    # A full limited queue takes no share.
    name = define(app, "app.record")
    # (`full` first in name order: a claim of one with turn 0 takes from it,
    # whatever other queue has due work)
    queues, full = [unique("lq"), unique("lq")], "0" + unique("lq")
    app.one(f"SELECT flow.set_queue('{full}', concurrency => 1)")
    enqueue_tagged = lambda q, n: app.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('tag',"
                                          f" 'lock')), queue => '{q}') FROM generate_series(1, {n})")
    with app.engine_paused(settle=1.5):
        enqueue_tagged(full, 2)
        # (claimed and leased, as a worker does: its one running, it is full)
        assert app.one("WITH c AS (SELECT * FROM flow._claim(1, NULL, 0) WHERE queue = %s)"
                       " SELECT count(*) FROM flow._lease('t', pg_backend_pid(), now(), NULL,"
                       " (SELECT array_agg(command_id) FROM c), (SELECT array_agg(row_at) FROM c),"
                       " (SELECT array_agg(deadline) FROM c))", full) == 1
        for q in queues:
            enqueue_tagged(q, 10)
        with app.connect(autocommit=False) as claimer:
            claimed = claimer.execute(
                "SELECT queue, count(*) FROM flow._claim(4, NULL, 0)"
                " WHERE queue = ANY (%s) GROUP BY queue ORDER BY queue", (queues,)).fetchall()
            assert claimed == [(q, 2) for q in sorted(queues)]    # each queue's share, interleaved
            free = app.one("SELECT count(*) FROM (SELECT 1 FROM flow._commands WHERE queue = ANY (%s)"
                           " FOR UPDATE SKIP LOCKED) c", queues)
            assert free == 16, free     # 4 locked: the 4 claimed, no more
            claimer.rollback()
    app.wait_for("SELECT count(*) = 0 FROM flow.commands WHERE queue = ANY (%s) AND status <> 'succeeded'",
                 queues + [full], timeout=30)


def test_queues_without_work_take_no_turns_and_batches_keep_the_interleaving(pg):
    queues = [unique(f"f{i}") for i in range(5)]
    for q in queues:
        pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    a, e = queues[0], queues[4]
    for q in (a, e):
        name = define(pg, ACT, queue=f"'{q}'")
        pg.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('tag', '{q}', 'do', 'sleep',"
               f" 'seconds', 0.15)), queue => '{q}') FROM generate_series(1, 12)")
    # all at once, so no queue gets a head start
    pg.one("SELECT count(flow.set_queue(q, paused => false)) FROM unnest(%s::text[]) q", queues)
    pg.wait_for(f"SELECT count(*) >= 12 FROM app.effects WHERE tag IN ('{a}', '{e}')", timeout=60)
    first = [r[0] for r in pg.all(f"SELECT tag FROM app.effects WHERE tag IN ('{a}', '{e}') ORDER BY at LIMIT 12")]
    # the two busy queues share the first turns: neither gets 4 of every 5
    assert 4 <= first.count(a) <= 8, first


def test_a_worker_runs_the_commands_it_claimed_from_one_queue_in_due_order(pg):
    # (a claim from one queue hands its rows on in due order, with no claim
    # order of its own: see flow._claim's `picked`; a worker runs each chunk
    # of a claim in its transaction, so the commands one transaction ran are
    # in due order; a command handed back goes to a later claim)
    q = unique("due")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    pg.one("CREATE TABLE IF NOT EXISTS app.ran_in_order (command_id uuid, pid int, xact bigint DEFAULT txid_current(),"
           " at timestamptz DEFAULT clock_timestamp())")
    pg.one("CREATE OR REPLACE FUNCTION app.note_order(args jsonb, ctx flow.context) RETURNS void LANGUAGE sql AS"
           " $$ INSERT INTO app.ran_in_order (command_id, pid) VALUES (ctx.command_id, pg_backend_pid()) $$")
    name = unique("ord")
    pg.one(f"SELECT flow.define('{name}', 'app.note_order(jsonb, flow.context)'::regprocedure, queue => '{q}')")
    runs = []
    for _ in range(3):   # three due times, each with 100 ids
        runs += pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[100]))")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)")
    pg.wait_for("SELECT count(*) = 300 FROM app.ran_in_order WHERE command_id = ANY (%s)", runs)
    due = pg.all("SELECT id FROM flow._commands WHERE id = ANY (%s) ORDER BY next_run_at, id", runs)
    rank = {r[0]: i for i, r in enumerate(due)}
    by_transaction = {}
    for command, pid, xact in pg.all("SELECT command_id, pid, xact FROM app.ran_in_order"
                                     " WHERE command_id = ANY (%s) ORDER BY at", runs):
        by_transaction.setdefault((pid, xact), []).append(rank[command])
    assert max(len(order) for order in by_transaction.values()) > 10   # (batches, not one by one)
    for order in by_transaction.values():
        assert order == sorted(order), order


def test_a_worker_runs_a_claim_from_several_queues_round_robin_each_queue_in_due_order(pg):
    # (a worker's claim from several queues comes to it queue by queue, each
    # queue's share, and the worker runs it round-robin: claim.rs's
    # into_round_robin; each chunk of it runs in one transaction)
    queues = [unique("rra"), unique("rrb")]
    pg.one("CREATE TABLE IF NOT EXISTS app.ran_round_robin (command_id uuid, queue text, pid int,"
           " xact bigint DEFAULT txid_current(), at timestamptz DEFAULT clock_timestamp())")
    pg.one("CREATE OR REPLACE FUNCTION app.note_round_robin(args jsonb, ctx flow.context) RETURNS void LANGUAGE sql AS"
           " $$ INSERT INTO app.ran_round_robin (command_id, queue, pid) VALUES (ctx.command_id, ctx.queue,"
           " pg_backend_pid()) $$")
    runs = []
    for q in queues:
        pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
        name = unique("rr")
        pg.one(f"SELECT flow.define('{name}', 'app.note_round_robin(jsonb, flow.context)'::regprocedure, queue => '{q}')")
        for _ in range(3):   # three due times in each queue, each with 100 ids
            runs += pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[100]))")
    pg.one("SELECT count(flow.set_queue(q, paused => false)) FROM unnest(%s::text[]) q", queues)
    pg.wait_for("SELECT count(*) = 600 FROM app.ran_round_robin WHERE command_id = ANY (%s)", runs)
    due = pg.all("SELECT id FROM flow._commands WHERE id = ANY (%s) ORDER BY next_run_at, id", runs)
    rank = {r[0]: i for i, r in enumerate(due)}
    by_transaction = {}
    for command, queue, pid, xact in pg.all("SELECT command_id, queue, pid, xact FROM app.ran_round_robin"
                                            " WHERE command_id = ANY (%s) ORDER BY at", runs):
        by_transaction.setdefault((pid, xact), []).append((queue, rank[command]))
    mixed = [ran for ran in by_transaction.values() if len({q for q, _ in ran}) == 2]
    assert mixed and max(len(ran) for ran in mixed) > 10   # (batches from both queues, not one by one)
    for ran in by_transaction.values():
        # each queue's commands in due order
        for q in queues:
            ranks = [r for queue, r in ran if queue == q]
            assert ranks == sorted(ranks), (q, ranks)
        # the queues taking turns while both have commands left in the transaction
        both = 2 * min(sum(1 for queue, _ in ran if queue == q) for q in queues)
        turns = [queue for queue, _ in ran[:both]]
        assert all(a != b for a, b in zip(turns, turns[1:])), turns


def test_a_run_locked_elsewhere_does_not_hold_up_the_batch(pg):
    q = unique("hol")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    name = define(pg, ACT, queue=f"'{q}'")
    # (keyed: a run with a row of its own, which a client holds apart from its
    # root; the root spawns a child: a root alone needs no lock of its run)
    blocked = enqueue(pg, name, f'{{"tag": "blocked", "do": "spawn_no_waits", "child": "{name}"}}',
                      key=f"'{unique('blocked')}'")
    others = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[20]))")
    with pg.connect(autocommit=False) as holder:
        holder.execute("SELECT 1 FROM flow._runs WHERE id = %s FOR UPDATE", (blocked,))   # like an idle client
        pg.one(f"SELECT flow.set_queue('{q}', paused => false)")
        started = time.time()
        for run in others:
            assert pg.await_run(run, "10s")[0] == "succeeded"
        assert time.time() - started < 8
        assert pg.one("SELECT status FROM flow._run_rows WHERE id = %s", blocked) == "running"
        holder.rollback()
    assert pg.await_run(blocked, "30s")[0] == "succeeded"
    # the attempts that met the locked run were voided (counted, not charged), then each ran once more
    for (command,) in pg.all("SELECT id FROM flow.commands WHERE run_id = %s", blocked):
        outcomes = pg.all("SELECT outcome FROM flow.attempts WHERE command_id = %s ORDER BY attempt", command)
        assert outcomes[-1] == ("succeeded",) and set(outcomes[:-1]) <= {("voided",)}, outcomes


def test_concurrency_one_never_runs_two_at_once(app):
    name = define(app, "app.record", queue="'single'")
    app.one("SELECT flow.set_queue('single', concurrency => 1)")
    runs = app.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('tag', 'c1', 'q', i::text,"
                   " 'sleep', 0.02))) FROM generate_series(1, 30) i")
    for run in runs:
        assert app.await_run(run, "30s")[0] == "succeeded"
    spans = app.all("SELECT s.at, e.at FROM app.effects s JOIN app.effects e ON e.q = 'end:' || s.q"
                    " AND e.run_key = s.run_key WHERE s.run_key = 'c1' AND s.q NOT LIKE 'end:%' ORDER BY s.at")
    assert len(spans) == 30
    for (s1, e1), (s2, _) in zip(spans, spans[1:]):
        assert s2 >= e1, "two handlers of a concurrency-1 queue overlapped"


def test_paused_queue_is_skipped(app):
    name = define(app, "app.hello", queue="'paused_q'")
    app.one("SELECT flow.set_queue('paused_q', paused => true)")
    run = enqueue(app, name)
    time.sleep(0.5)   # (time itself: no claim takes it within 0.5 s)
    assert command(app, run)[0] == "pending"
    app.one("SELECT flow.set_queue('paused_q', paused => false)")
    assert app.await_run(run, "10s")[0] == "succeeded"


def test_future_work_runs_on_time(app):
    name = define(app, "app.hello")
    run = enqueue(app, name, start_after="'700 ms'")
    time.sleep(0.4)   # (time itself: not run before it is due)
    assert command(app, run)[0] == "pending"
    assert app.await_run(run, "10s")[0] == "succeeded"
    late = app.one("SELECT extract(epoch FROM a.started_at - c.created_at) FROM flow.attempts a"
                   " JOIN flow.commands c ON c.id = a.command_id WHERE a.run_id = %s", run)
    assert 0.69 <= float(late) < 1.5, late


# ---------------------------------------------------------------- wake-up

def test_pickup_is_fast(app):
    name = define(app, "app.record")
    app.wait_workers_asleep(2)  # idle workers, asleep on their latches
    delays = []
    with app.connect() as c:
        for i in range(20):
            t0 = c.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0]
            c.execute(f"SELECT flow.enqueue('{name}', jsonb_build_object('tag', 'pickup', 'q', %s::text))", (str(i),))
            app.wait_for("SELECT count(*) > 0 FROM app.effects WHERE run_key = 'pickup' AND q = %s", str(i))
            started = c.execute("SELECT extract(epoch FROM at) FROM app.effects WHERE run_key = 'pickup'"
                                " AND q = %s", (str(i),)).fetchone()[0]
            delays.append(float(started - t0))
            app.wait_workers_asleep(2)
    delays.sort()
    assert delays[len(delays) // 2] < 0.1, delays  # generous: the benchmark reports the real figure


# ---------------------------------------------------------------- held and leased attempts

def test_a_held_root_leaves_its_run_unlocked_and_its_failure_never_waits_for_the_run(app):
    """A run's root with no child is held without its run's lock (the lock
    would be the only write to the run's row). Its chunk never waits for that
    lock: an attempt cut while another session holds the run is voided at
    once, and the command runs again once the run is free."""
    name = define(app, "app.decides")
    seen_fast(app, name)
    # (a keyed run: it has a row of its own, which a canceller can hold apart
    # from its root; a run without a row is locked by its root's row)
    run = enqueue(app, name, '{"do": "sleep_then_raise", "seconds": 0.5, "tag": "rootlock"}',
                  key=f"'{unique('rootlock')}'")
    app.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    assert app.one("SELECT status FROM flow._commands WHERE run_id = %s", run) == "pending"   # held
    with app.connect(autocommit=False) as other:
        # not locked by the chunk that holds its root
        other.execute("SELECT 1 FROM flow._runs WHERE id = %s FOR UPDATE NOWAIT", (run,))
        # then the root, as flow.cancel takes them: this waits for the chunk,
        # whose failure must not wait for the run (a deadlock, one of the two
        # aborted a second later)
        other.execute("SELECT 1 FROM flow._commands WHERE id = %s FOR UPDATE", (run,))
        time.sleep(1.0)   # (time itself:) attempts fail meanwhile, none concluded (the first
        # held, then, the handler having failed, leased ones handed back)
        assert app.one("SELECT count(*) FROM flow.attempts WHERE run_id = %s AND outcome NOT IN ('running', 'voided')",
                       run) == 0
        other.rollback()
    assert app.await_run(run, "20s")[0] == "succeeded"
    # The held attempt, cut at its 100 ms budget while the run was held
    # elsewhere, is voided without waiting for the run: counted, not charged.
    # So are the leased ones whose settlement found the run still held (200 ms
    # at most each). Their writes were rolled back; the last attempt succeeds.
    outcomes = app.all("SELECT outcome, error_code FROM flow.attempts WHERE run_id = %s ORDER BY attempt", run)
    assert outcomes[0] == ("voided", "demoted") and outcomes[-1] == ("succeeded", None), outcomes
    assert all(o == ("voided", "run_locked") for o in outcomes[1:-1]), outcomes
    assert app.all("SELECT attempt FROM app.effects WHERE run_key = 'rootlock'") == [(len(outcomes),)]


def test_held_attempts_that_share_a_subtransaction_commit_once_when_one_fails(app):
    """Held attempts of a handler that has not failed lately share one
    subtransaction (execute.rs, GROUP_SIZE). When one of them fails, the
    group is rolled back and its earlier members run again, each alone: every
    success writes exactly once, a failure nothing, and a failure that keeps
    its writes (flow.fail keep_writes) once."""
    app.all("""
        CREATE FUNCTION app.grouped(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO app.effects (run_key, attempt) VALUES (args->>'tag', ctx.attempt);
            CASE args->>'do'
                WHEN 'raise' THEN RAISE EXCEPTION 'broken';
                WHEN 'fail_keeping' THEN PERFORM flow.fail('kept', keep_writes => true);
                ELSE NULL;
            END CASE;
            RETURN jsonb_build_object('tag', args->>'tag');
        END $$;
    """)
    queue = unique("grouped")
    name = define(app, "app.grouped", max_attempts=1, queue=f"'{queue}'")
    # (not at multiples of 20: claims and chunks, sized after the rounds of
    # 20 above, tend to begin there, and an attempt that begins its group
    # has no members to run again; a worker runs a handler alone for a while
    # after its first failure)
    special = {67: "raise", 133: "fail_keeping", 134: "raise", 251: "raise"}
    # Whether a failure finds members before it in its group depends on
    # where the workers' claims and groups begin and on which worker has seen
    # the handler finish fast (wake-one keeps one worker serving a light
    # load): a burst in which no failure had a member before it is possible.
    # Every burst is checked in full; up to three are run until one shows
    # the rerun of a group.
    for burst in range(3):
        seen_fast(app, name)
        reruns = app.one("SELECT value FROM flow.stats WHERE name = 'group_reruns'")
        app.one("SELECT flow.set_queue(%s, paused => true)", queue)
        tag = f"g{burst}_"
        args = [json.dumps({"tag": f"{tag}{i}", "do": special.get(i, "none")}) for i in range(300)]
        runs = app.one(f"SELECT flow.enqueue_many('{name}', %s::jsonb[])", args)
        app.one("SELECT flow.set_queue(%s, paused => false)", queue)
        outcomes = [app.await_run(run, "30s") for run in runs]
        for i, (status, result, error) in enumerate(outcomes):
            if i in special:
                assert status == "failed", i
            else:
                assert (status, result) == ("succeeded", {"tag": f"{tag}{i}"}), i
        effects = dict(app.all("SELECT run_key, count(*) FROM app.effects WHERE run_key LIKE %s GROUP BY run_key",
                               tag + "%"))
        expected = {f"{tag}{i}": 1 for i in range(300) if special.get(i) != "raise"}
        assert effects == expected
        assert app.all("SELECT DISTINCT attempts FROM flow.commands WHERE run_id = ANY (%s)", runs) == [(1,)]
        # the failures ran in groups: the members before them ran again
        if app.one("SELECT value FROM flow.stats WHERE name = 'group_reruns'") > reruns:
            break
    else:
        pytest.fail("in three bursts no failure had a member before it in its group")


@pytest.mark.parametrize("language", ["sql", "plpgsql"])
def test_a_handler_sees_its_whole_context_leased_and_held(app, language):
    """The context is the claim's composite with the attempt's deadline and
    start filled in (payload.rs, Context): every field says what the tables
    say, for the first (leased) attempts and the later (held) ones alike,
    given through SPI (a `LANGUAGE sql` handler) or a direct call (others)."""
    body = {"sql": "SELECT to_jsonb(ctx) || jsonb_build_object('now', clock_timestamp())",
            "plpgsql": "BEGIN RETURN to_jsonb(ctx) || jsonb_build_object('now', clock_timestamp()); END"}[language]
    app.all(f"""
        CREATE FUNCTION app.echo_context_{language}(args jsonb, ctx flow.context) RETURNS jsonb
        LANGUAGE {language} AS $$ {body} $$;
    """)
    name = define(app, f"app.echo_context_{language}", timeout="'1 hour'")
    for round_ in range(4):
        runs = [enqueue(app, name, '{"i": %d}' % i, key=f"'{language}{round_}-{i}'") for i in range(15)]
        for i, run in enumerate(runs):
            status, ctx, _ = app.await_run(run, "10s")
            assert status == "succeeded"
            row = app.one("SELECT jsonb_build_object('run_id', c.run_id, 'run_key', r.key, 'command_id', c.id,"
                          " 'command_key', c.key, 'name', c.name, 'version', c.version, 'queue', c.queue,"
                          " 'created_at', c.created_at, 'budget_started_at', x.budget_started_at)"
                          " FROM flow.commands c JOIN flow.runs r ON r.id = c.run_id JOIN flow._commands x ON x.id = c.id"
                          " WHERE c.run_id = %s", run)
            assert {k: ctx[k] for k in row} == row
            assert row["run_key"] == f"{language}{round_}-{i}"
            assert (ctx["attempt"], ctx["inputs"], ctx["missing"], ctx["wait_timed_out"]) == (1, [], [], False)
            started = app.one("SELECT started_at FROM flow.attempts WHERE run_id = %s", run)
            assert app.one("SELECT %s::timestamptz = %s", ctx["attempt_started_at"], started)
            assert app.one("SELECT %s::timestamptz <= %s::timestamptz", ctx["attempt_started_at"], ctx["now"])
            assert app.one("SELECT %s::timestamptz - %s::timestamptz = interval '1 hour'",
                           ctx["deadline"], ctx["attempt_started_at"])


def test_await_times_out_on_a_running_run(app):
    name = define(app, "app.hello")
    run = enqueue(app, name, start_after="'1 hour'")
    t0 = time.time()
    assert app.await_run(run, "300 ms")[0] == "running"
    assert 0.25 < time.time() - t0 < 2


# ---------------------------------------------------------------- observe and operate

def test_observability_views(app):
    name = define(app, "app.decides", queue="'observed'")
    run = enqueue(app, name, '{"do": "sleep", "seconds": 1}')
    app.wait_for("SELECT count(*) = 1 FROM flow.workers WHERE state = 'busy' AND command_id IS NOT NULL")
    assert app.one("SELECT running FROM flow.queues WHERE name = 'observed'") == 1
    assert "flow" in app.one("SELECT query FROM pg_stat_activity WHERE backend_type = 'flow worker'"
                             " AND query LIKE 'flow: running%' LIMIT 1")
    assert app.one("SELECT outcome FROM flow.attempts WHERE run_id = %s", run) == "running"
    app.await_run(run, "10s")
    assert app.one("SELECT succeeded FROM flow.queue_history WHERE name = 'observed'") == 1
    stats = dict(app.all("SELECT name, value FROM flow.stats"))
    assert stats["claimed"] > 0 and stats["attempts_succeeded"] > 0 and stats["claims"] > 0
    assert app.one("SELECT sum(attempts) FROM flow.recent_attempts") > 0


def counters(pg):
    return dict(pg.all("SELECT name, value FROM flow.stats"))


def test_counters_count_what_committed_by_outcome_stop_and_status(pg):
    before = counters(pg)
    ok, fails = define(pg, ACT), define(pg, ACT, max_attempts=1)
    retried = define(pg, ACT, backoff="'10 ms'", backoff_max="'10 ms'")
    runs = [enqueue(pg, ok, '{"do": "compensate", "tag": "obs"}'),          # permanent (kept), 1 event
            enqueue(pg, fails, '{"do": "bad_spawn"}'),                     # permanent invalid_decision
            enqueue(pg, retried, '{"do": "fail_first"}'),                  # retryable, then succeeded
            enqueue(pg, ok), enqueue(pg, ok)]                              # succeeded
    for run in runs:
        pg.await_run(run)
    cancelled = enqueue(pg, ok, start_after="'1 hour'")
    pg.one("SELECT flow.cancel(%s)", cancelled)
    after = counters(pg)
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert delta["attempts_succeeded"] == 3
    assert delta["attempts_permanent"] == 2
    assert delta["attempts_retryable"] == 1
    assert delta["stops_permanent"] == 2
    assert delta["runs_succeeded"] == 3 and delta["runs_failed"] == 2 and delta["runs_cancelled"] == 1
    assert delta["events"] == 1                 # the kept failure's event; nothing rolled back is counted
    assert delta["claimed"] >= 6 and delta["claim_us"] > 0 and delta["handler_us"] > 0
    lines = [r[0] for r in pg.all("SELECT line FROM flow.prometheus")]
    assert f'flow_attempts_total{{outcome="succeeded"}} {after["attempts_succeeded"]}' in lines
    assert "# TYPE flow_runs_ended_total counter" in lines


def test_an_attempt_is_timed_from_its_handlers_start(pg):
    q = unique("timed")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    name = define(pg, ACT, queue=f"'{q}'")
    slow = enqueue(pg, name, '{"do": "sleep", "seconds": 0.6}')
    quick = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[5]))")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)")
    for run in [slow, *quick]:
        assert pg.await_run(run)[0] == "succeeded"
    durations = [r[0].total_seconds() for r in pg.all(
        "SELECT duration FROM flow.attempts WHERE run_id = ANY(%s::uuid[])", quick)]
    assert len(durations) == 5 and max(durations) < 0.3, durations
    assert pg.one("SELECT duration FROM flow.attempts WHERE run_id = %s AND outcome = 'succeeded'",
                  slow).total_seconds() >= 0.6


def test_queue_counts_show_what_is_live_and_the_history_apart(app):
    """flow.queues counts a role's unfinished commands per queue (by the
    claim's indexes: polling it costs the backlog, not the retained history);
    flow.queue_history counts its finished ones. Both show only the caller's own."""
    app.all("DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;"
            " EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    name = define(app, "app.hello", queue="'counted'")
    app.one("SELECT flow.set_queue('counted', paused => true)")
    app.one("SELECT flow.grant_queue('counted', 'bob')")
    for _ in range(2):
        enqueue(app, name)
    later = enqueue(app, name, start_after="'1 hour'")
    live = "SELECT pending, due, waiting, running FROM flow.queues WHERE name = 'counted'"
    history = "SELECT succeeded, failed, cancelled FROM flow.queue_history WHERE name = 'counted'"
    assert app.all(live) == [(3, 2, 0, 0)]
    assert app.all(history) == [(0, 0, 0)]
    # bob may use the queue but sees none of postgres' commands in it
    assert app.all(live, user="bob") == [(0, 0, 0, 0)]
    app.one("SELECT flow.set_queue('counted', paused => false)")
    app.wait_for("SELECT succeeded = 2 FROM flow.queue_history WHERE name = 'counted'")
    assert app.all(live) == [(1, 0, 0, 0)]
    app.one("SELECT flow.cancel(%s)", later)
    assert app.all(live) == [(0, 0, 0, 0)]
    assert app.all(history) == [(2, 0, 1)]
    assert app.all(history, user="bob") == [(0, 0, 0)]
    assert app.one("SELECT count(*) FROM flow.queue_history WHERE name = 'counted'", user="alice") == 0


def test_queue_counts_and_drop_see_each_lane_of_a_queue(app):
    """The due index keys a lane (a queue and who claims from it: in-database
    workers, or an external definition's workers) by a hash: flow.queues and
    flow.drop_queue read every lane of the queue."""
    q = unique("lanes")
    app.one(f"SELECT flow.set_queue('{q}', paused => true)")
    inner = define(app, "app.hello")
    outer = unique("ext")
    app.one(f"SELECT flow.define('{outer}', NULL)")
    for name in (inner, outer, outer):
        enqueue(app, name, queue=f"'{q}'")   # (their definitions' queue is another)
    assert app.all(f"SELECT pending, due FROM flow.queues WHERE name = '{q}'") == [(3, 3)]
    assert app.sqlstate(f"SELECT flow.drop_queue('{q}')") == "2BP01"
    app.one(f"SELECT flow.cancel(run_id) FROM flow.commands WHERE queue = '{q}' AND name = '{inner}'")
    assert app.all(f"SELECT pending, due FROM flow.queues WHERE name = '{q}'") == [(2, 2)]
    assert app.sqlstate(f"SELECT flow.drop_queue('{q}')") == "2BP01"   # the external ones wait in it
    app.one(f"SELECT count(flow.cancel(run_id)) FROM flow.commands WHERE queue = '{q}' AND name = '{outer}'")
    assert app.all(f"SELECT pending, due FROM flow.queues WHERE name = '{q}'") == [(0, 0)]
    assert app.one(f"SELECT flow.drop_queue('{q}')") is True


def test_drop_queue_waits_for_what_is_being_put_in_the_queue(app):
    """flow.drop_queue waits for the transactions putting a command in the
    queue to commit, whether they name it or it is their definition's own,
    and then refuses (a definition moved to another queue, its old queue
    dropped while an enqueue that read the old home was open: the drop said
    true and the run stayed in a queue no claim reads, forever)."""
    old, new = unique("old_home"), unique("new_home")
    name = unique("ext")
    app.one(f"SELECT flow.define('{name}', NULL, queue => '{old}')")
    app.one(f"SELECT flow.set_queue('{new}')")
    with app.connect(autocommit=False) as moving, app.connect(autocommit=False) as enqueuing:
        moving.execute(f"SELECT flow.define('{name}', NULL, queue => '{new}')")
        run = enqueuing.execute(f"SELECT flow.enqueue('{name}')").fetchone()[0]   # into the old home
        moving.commit()
        drop = app.waiting_call(f"SELECT flow.drop_queue('{old}')", None, "%drop_queue%")
        enqueuing.commit()
    assert drop() == "2BP01"
    assert app.one("SELECT queue FROM flow.commands WHERE id = %s", run) == old
    with app.connect() as c:
        assert c.execute("SELECT command_id FROM flow.claim(%s, 'w', 10)", ([name],)).fetchall() == [(run,)]


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_drop_queue_refuses_a_snapshot_older_than_its_waits(app, isolation):
    """In a transaction whose snapshot predates the enqueues it waits for,
    flow.drop_queue could not see their commands, and dropped a queue a
    command had just been put in (0.2.0: it stayed pending forever). It
    refuses with 0A000, and the queue stays."""
    q = unique("rr_home")
    name = unique("ext")
    app.one(f"SELECT flow.define('{name}', NULL)")
    app.one(f"SELECT flow.set_queue('{q}')")
    with app.connect(autocommit=False) as dropping, app.connect(autocommit=False) as enqueuing:
        dropping.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        dropping.execute("SELECT 1")   # (its snapshot, before the enqueue commits)
        run = enqueuing.execute(f"SELECT flow.enqueue('{name}', queue => '{q}')").fetchone()[0]
        enqueuing.commit()
        with pytest.raises(psycopg.Error) as caught:
            dropping.execute(f"SELECT flow.drop_queue('{q}')")
        assert caught.value.sqlstate == "0A000"
    assert app.one(f"SELECT count(*) FROM flow._queues WHERE name = '{q}'") == 1
    with app.connect() as c:
        assert c.execute("SELECT command_id FROM flow.claim(%s, 'w', 10)", ([name],)).fetchall() == [(run,)]


def test_an_enqueue_into_a_queue_being_dropped_is_told_to_try_again(app):
    """An enqueue that names a queue while flow.drop_queue drops it waits for
    the drop, then fails with 40001 and changes nothing; tried again, its
    queue is made anew, as for any queue named the first time."""
    q = unique("dropped")
    name = unique("ext")
    app.one(f"SELECT flow.define('{name}', NULL)")
    app.one(f"SELECT flow.set_queue('{q}')")
    with app.connect(autocommit=False) as dropping:
        assert dropping.execute(f"SELECT flow.drop_queue('{q}')").fetchone()[0] is True
        enqueue = app.waiting_call(f"SELECT flow.enqueue('{name}', queue => '{q}')", None, "%flow.enqueue%")
        dropping.commit()
    assert enqueue() == "40001"
    assert app.one("SELECT count(*) FROM flow.commands WHERE name = %s", name) == 0
    run = app.one(f"SELECT flow.enqueue('{name}', queue => '{q}')")
    assert app.one("SELECT queue FROM flow.commands WHERE id = %s", run) == q
    assert app.one(f"SELECT count(*) FROM flow._queues WHERE name = '{q}'") == 1


def test_enabled_off_pauses_all_work(app):
    name = define(app, "app.hello")
    with app.engine_paused(settle=1.5):
        run = enqueue(app, name)
        time.sleep(1.0)   # (time itself: nothing runs it within a second)
        assert command(app, run)[0] == "pending"
    assert app.await_run(run, "10s")[0] == "succeeded"


# ---------------------------------------------------------------- a run's rows

def test_a_run_of_one_command_is_its_root_alone(app):
    """A run without a key is its root command: enqueue writes no row of the
    run's own, and its only command succeeding writes that command alone. The
    run is seen, and seen ended, with the command's result and end, by
    flow.runs, flow.await, flow.cancel and the pruning."""
    name = define(app, "app.hello")
    run = enqueue(app, name, '{"who": "one"}')
    assert app.one("SELECT count(*) FROM flow._runs WHERE id = %s", run) == 0
    assert app.all("SELECT name, args, owner::text FROM flow.runs WHERE id = %s", run) == [(name, {"who": "one"}, "postgres")]
    status, result, error = app.await_run(run, "10s")
    assert (status, result["hello"], error) == ("succeeded", "one", None)
    assert app.one("SELECT count(*) FROM flow._runs WHERE id = %s", run) == 0
    assert app.all("SELECT r.status, r.result, r.finished_at = c.finished_at, r.attempts FROM flow.runs r"
                   " JOIN flow.commands c ON c.run_id = r.id WHERE r.id = %s", run) == [("succeeded", result, True, 1)]
    assert app.one("SELECT flow.cancel(%s)", run) is False
    assert app.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
    app.wait_for("SELECT finished_at < now() - interval '1.01 s' FROM flow.runs WHERE id = %s", run)   # (past the cut)
    after = app.one("SELECT id FROM flow._run_rows WHERE id < %s ORDER BY id DESC LIMIT 1", run)
    assert app.all("SELECT pruned, last FROM flow._prune('1 s', 1, %s)", after) == [(1, run)]
    assert app.one("SELECT count(*) FROM flow._run_rows WHERE id = %s", run) == 0
    assert app.one("SELECT count(*) FROM flow._commands WHERE run_id = %s", run) == 0


def test_a_run_gets_a_row_of_its_own_only_when_its_root_alone_cannot_tell_it(app):
    """A run without a key is its root command until it needs more (see
    sql/schema.sql, flow._runs): enqueue and enqueue_many write no run row; a
    key, the root's first child, a terminal failure and a cancel each give the
    run its row (and so does a worker's lease of its root, see the next
    test), and flow.runs shows each run the same before and after."""
    app.all("""
        CREATE FUNCTION app.parent_of_one(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM flow.spawn(args->>'child', '{"who": "kid"}', key => 'kid');
            RETURN '{"spawned": true}';
        END $$;""")
    app.one("SELECT flow.set_queue('rowless', paused => true)")   # (until the rows are counted)
    hello = define(app, "app.hello", queue="'rowless'")
    decides = define(app, "app.decides", max_attempts=1, queue="'rowless'")
    parent = define(app, "app.parent_of_one", queue="'rowless'")
    plain = enqueue(app, hello, '{"who": "plain"}')
    many = app.one(f"SELECT flow.enqueue_many('{hello}', array_fill('{{}}'::jsonb, array[3]))")
    keyed = enqueue(app, hello, key=f"'{unique('k')}'")
    failing = enqueue(app, decides, '{"do": "fail", "tag": "rowless"}')
    spawning = enqueue(app, parent, f'{{"child": "{hello}"}}')
    to_cancel = enqueue(app, hello, '{"who": "never"}')
    runs = [plain, *many, keyed, failing, spawning, to_cancel]
    before = app.all("SELECT id, name, owner::text, args, created_at, deadline FROM flow.runs"
                     " WHERE id = ANY (%s) ORDER BY id", runs)
    assert len(before) == len(runs)
    assert app.one("SELECT array_agg(id) FROM flow._runs WHERE id = ANY (%s)", runs) == [keyed]
    assert app.one("SELECT status FROM flow.runs WHERE id = %s", to_cancel) == "running"
    assert app.one("SELECT flow.cancel(%s)", to_cancel) is True
    app.one("SELECT flow.set_queue('rowless', paused => false)")
    for run in (plain, *many, keyed, spawning):
        assert app.await_run(run, "10s")[0] == "succeeded"
    status, _, error = app.await_run(failing, "10s")
    assert (status, error["message"], error["stop_reason"]) == ("failed", "card declined", "permanent")
    assert app.all("SELECT key, status::text FROM flow.commands WHERE run_id = %s ORDER BY key", spawning) == \
        [("kid", "succeeded"), ("root", "succeeded")]
    assert app.all("SELECT status::text, stop_reason FROM flow.commands WHERE run_id = %s", to_cancel) == \
        [("cancelled", "cancelled")]
    # rows for the runs the root alone could not tell: a key, a child, a failure, a cancel
    # (the others have one too if a worker leased their root: flow._claim)
    assert set(app.one("SELECT array_agg(id) FROM flow._runs WHERE id = ANY (%s)", runs)) >= \
        {keyed, failing, spawning, to_cancel}
    assert app.all("SELECT id, name, owner::text, args, created_at, deadline FROM flow.runs"
                   " WHERE id = ANY (%s) ORDER BY id", runs) == before
    assert app.all("SELECT status::text FROM flow.runs WHERE id = ANY (%s) ORDER BY id",
                   [plain, keyed, failing, spawning, to_cancel]) == \
        [(s,) for _, s in sorted([(plain, "succeeded"), (keyed, "succeeded"), (failing, "failed"),
                                  (spawning, "succeeded"), (to_cancel, "cancelled")])]


def test_leased_commands_settle_without_a_multixact_or_a_run_row(app):
    """A leased command's run is locked at its settlement, in the same
    subtransaction that writes the command (src/execute.rs, run_leased): a
    run without a row of its own is locked by its root's row, which is
    written by the same subtransaction that locked it, so no MultiXact is
    made (whose index entries scans never mark dead), and the run gets no
    row (a run of one command ends with its root)."""
    app.one("SELECT flow.set_queue('leased_rows', concurrency => 50)")   # a limited queue: leased claims
    name = define(app, "app.hello", queue="'leased_rows'")
    app.all("CHECKPOINT")
    before = app.one("SELECT next_multixact_id FROM pg_control_checkpoint()")
    runs = app.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[200]))")
    for run in runs:
        assert app.await_run(run, "20s")[0] == "succeeded"
    app.all("CHECKPOINT")
    assert app.one("SELECT next_multixact_id FROM pg_control_checkpoint()") == before
    assert app.one("SELECT count(*) FROM flow._runs WHERE id = ANY (%s)", runs) == 0
    assert app.one("SELECT count(*) FROM flow.attempts WHERE run_id = ANY (%s)", runs) == 200


def test_a_command_row_that_breaks_an_invariant_is_refused(app):
    """The invariants of a command row (state, lease, attempt, outcome) are one
    CHECK constraint calling flow._command_row_is_consistent (src/invariants.rs):
    a row that breaks any of them is refused with check_violation, and a row
    in each state the engine writes is accepted."""
    queue = unique("q")
    app.one("SELECT flow.set_queue(%s, paused => true)", queue)
    run = enqueue(app, define(app, "app.hello", queue=f"'{queue}'"))
    lease = "lease_token = gen_random_uuid(), lease_expires_at = now(), attempt_started_at = now()"
    breaks = ["attempts = -1", f"status = 'running', {lease}", "finished_at = now()", "stop_reason = 'tired'",
              "lease_token = gen_random_uuid()", "lease_expires_at = now()", "attempt_started_at = now()",
              "lease_pid = 1", "result = '{}'", "status = 'failed'",
              f"status = 'failed', finished_at = now(), attempts = 1, {lease}",
              "status = 'succeeded', finished_at = now(), lease_expires_at = now()"]
    for change in breaks:
        assert app.sqlstate(f"UPDATE flow._commands SET {change} WHERE id = %s", run) == "23514", change
    kept = [f"status = 'running', attempts = 1, lease_pid = 1, {lease}",
            "status = 'succeeded', attempts = 1, finished_at = now(), result = '{}', lease_token = gen_random_uuid(),"
            " attempt_started_at = now()",
            "status = 'failed', attempts = 1, finished_at = now(), stop_reason = 'attempt_limit'",
            "status = 'waiting'"]
    for change in kept:
        with app.connect(autocommit=False) as c:
            assert c.execute(f"UPDATE flow._commands SET {change} WHERE id = %s", (run,)).rowcount == 1, change
            c.rollback()
    assert app.one("SELECT status FROM flow._commands WHERE id = %s", run) == "pending"


# ---------------------------------------------------------------- last: this module's whole history pruned, then the extension dropped

def test_finished_runs_are_pruned_after_the_retention(app):
    name = define(app, "app.hello")
    done = enqueue(app, name)
    assert app.await_run(done, "10s")[0] == "succeeded"
    waiting = enqueue(app, name, start_after="'1 hour'")
    assert app.one("SELECT pruned FROM flow._prune('1 hour', 1000, NULL)") == 0   # too recent
    app.all("ALTER SYSTEM SET flow.retention = '1s'")
    app.all("SELECT pg_reload_conf()")
    try:
        app.wait_for("SELECT count(*) = 0 FROM flow._run_rows WHERE id = %s", done, timeout=20)
    finally:
        app.all("ALTER SYSTEM RESET flow.retention")
        app.all("SELECT pg_reload_conf()")
    assert app.one("SELECT count(*) FROM flow._commands c WHERE c.run_id = %s", done) == 0
    # every run of this module ended by now went (runs retried before they
    # succeeded, failed ones, cancelled ones), and nothing of theirs stayed
    assert app.one("SELECT count(*) FROM flow._attempts a WHERE a.command_id NOT IN"
                   " (SELECT id FROM flow._commands)") == 0
    assert app.one("SELECT count(*) FROM flow._waits w WHERE w.command_id NOT IN"
                   " (SELECT id FROM flow._commands)") == 0
    assert app.one("SELECT status FROM flow.runs WHERE id = %s", waiting) == "running"


def test_workers_wait_calmly_without_the_extension(app):
    app.all("DROP EXTENSION flow CASCADE")
    time.sleep(2.5)   # (time itself: the workers stay up, with no error loop, while it is missing)
    assert app.one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'flow worker'") == 2
    app.all("CREATE EXTENSION flow")
    app.all("CREATE OR REPLACE FUNCTION app.hello2(args jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT args $$")
    name = define(app, "app.hello2")
    run = enqueue(app, name, '{"back": true}')
    assert app.await_run(run, "15s") == ("succeeded", {"back": True}, None)
    # no error loop in the log while the extension was missing
    assert app.log().count("flow worker:") < 5
