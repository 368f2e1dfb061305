"""Rules of the reference runtime that 0.1.0 broke: sagas that compensate,
cancel, waits, fairness, heartbeats, head-of-line blocking, decisions and
budgets. Each test failed against 0.1.0."""
import threading
import time

import pytest

from conftest import fresh_cluster, unique


@pytest.fixture(scope="module")
def pg():
    # a long poll interval: anything that is quick here was woken, not polled
    cluster = fresh_cluster("flow.workers = 2", "flow.poll_interval = '10s'")
    with cluster.connect() as c:
        c.execute("""
            CREATE SCHEMA app;
            CREATE TABLE app.effects (tag text, at timestamptz DEFAULT clock_timestamp());
            CREATE FUNCTION app.act(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects (tag) VALUES (coalesce(args->>'tag', ctx.command_key));
                CASE args->>'do'
                    WHEN 'compensate' THEN
                        INSERT INTO app.effects (tag) VALUES ('refund:' || (args->>'tag'));
                        PERFORM flow.emit('refunded', args->>'tag');
                        PERFORM flow.fail('could not ship', keep_writes => true);
                        RETURN '{"returned": "after fail"}';
                    WHEN 'sleep' THEN PERFORM pg_sleep((args->>'seconds')::float);
                    WHEN 'sleep_first' THEN
                        IF NOT EXISTS (SELECT 1 FROM app.effects WHERE tag = 'slept:' || (args->>'tag')) THEN
                            INSERT INTO app.effects (tag) VALUES ('slept:' || (args->>'tag'));
                            PERFORM pg_sleep((args->>'seconds')::float);
                        END IF;
                    WHEN 'cancel_self' THEN PERFORM flow.cancel(ctx.run_id);
                    WHEN 'stubborn' THEN
                        LOOP BEGIN PERFORM pg_sleep(10); EXCEPTION WHEN query_canceled THEN NULL; END; END LOOP;
                    WHEN 'swallow_timeout' THEN
                        BEGIN PERFORM pg_sleep(5); EXCEPTION WHEN query_canceled THEN NULL; END;
                    WHEN 'bad_spawn' THEN
                        BEGIN PERFORM flow.spawn('no_such_definition', '{}', key => 'x');
                        EXCEPTION WHEN OTHERS THEN NULL; END;
                    WHEN 'spawn_no_waits' THEN
                        PERFORM flow.spawn(args->>'child', '{}', key => 'child', waits => NULL);
                    WHEN 'spawn_waiting' THEN
                        PERFORM flow.spawn(args->>'child', '{}', key => 'child',
                                           waits => array[flow.wait('never', ctx.run_id::text)]);
                    WHEN 'spawn_for_event' THEN
                        PERFORM flow.spawn(args->>'child', jsonb_build_object('do', 'fail_first'), key => 'child',
                                           waits => array[flow.wait('go', args->>'tag')], within => '1 minute');
                    WHEN 'fail_first' THEN
                        IF ctx.attempt = 1 THEN RAISE EXCEPTION 'first attempt fails'; END IF;
                    ELSE NULL;
                END CASE;
                RETURN jsonb_build_object('attempt', ctx.attempt);
            END $$;
        """)
    yield cluster
    cluster.stop()


def define(pg, **kw):
    name = unique("d")
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    pg.one(f"SELECT flow.define('{name}', 'app.act(jsonb, flow.context)'::regprocedure{params})")
    return name


def enqueue(pg, name, args="{}", **kw):
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    return pg.one(f"SELECT flow.enqueue('{name}', '{args}'{params})")


def root(pg, run):
    return pg.all("SELECT status::text, attempts, stop_reason, last_error_code FROM flow._commands"
                  " WHERE run_id = %s AND key = 'root'", run)[0]


def effects(pg, tag):
    return pg.one("SELECT count(*) FROM app.effects WHERE tag = %s", tag)


# ---------------------------------------------------------------- 1. sagas

def test_fail_keeping_writes_commits_the_compensation(pg):
    tag = unique("order")
    run = enqueue(pg, define(pg), f'{{"do": "compensate", "tag": "{tag}"}}')
    status, result, error = pg.await_run(run)
    assert status == "failed" and result is None
    assert error["message"] == "could not ship" and error["stop_reason"] == "permanent"
    assert root(pg, run)[:3] == ("failed", 1, "permanent")
    # the refund and the event committed with the failed settlement
    assert effects(pg, "refund:" + tag) == 1 and effects(pg, tag) == 1
    assert pg.one("SELECT count(*) FROM flow.events WHERE name = 'refunded' AND key = %s", tag) == 1
    assert pg.sqlstate("SELECT flow.fail('x', keep_writes => true)") == "FL012"


def test_the_demo_saga_refunds(pg):
    from pathlib import Path
    sql = (Path(__file__).resolve().parent.parent / "examples" / "order_workflow.sql").read_text()
    with pg.connect() as c:
        c.execute(sql)
    run = pg.one("""SELECT flow.enqueue('place_order', '{"order": "o-9", "amount": 5, "sku": "unicorn",
                                                          "within": "3 seconds"}')""")
    assert pg.await_run(run)[0] == "failed"
    assert pg.one("SELECT refunded FROM shop.charges WHERE order_id = 'o-9'") is True
    assert pg.one("SELECT count(*) FROM shop.shipments WHERE order_id = 'o-9'") == 0


# ---------------------------------------------------------------- 2. cancel

def test_cancel_on_the_last_attempt_ends_the_run_cancelled(pg):
    run = enqueue(pg, define(pg, max_attempts=1), '{"do": "sleep", "seconds": 3}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    time.sleep(0.3)
    assert pg.one("SELECT flow.cancel(%s)", run) is True
    assert pg.await_run(run)[0] == "cancelled"
    assert root(pg, run)[0] == "cancelled"


def test_a_cancel_that_rolls_back_leaves_nothing_stuck(pg):
    tag = unique("rb")
    run = enqueue(pg, define(pg), f'{{"do": "sleep_first", "seconds": 2, "tag": "{tag}"}}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    time.sleep(0.3)
    with pg.connect(autocommit=False) as c:
        assert c.execute("SELECT flow.cancel(%s)", (run,)).fetchone()[0] is True
        c.rollback()
    # the handed-back command runs again and the run finishes
    assert pg.await_run(run)[0] == "succeeded"
    assert root(pg, run)[0] == "succeeded"


def test_concurrent_cancels_each_end_their_run(pg):
    name = define(pg)
    runs = [enqueue(pg, name, '{"do": "sleep", "seconds": 5}') for _ in range(2)]
    pg.wait_for("SELECT count(*) = 2 FROM flow.commands WHERE run_id = ANY(%s::uuid[]) AND status = 'running'",
                runs)
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, pg.one("SELECT flow.cancel(%s)", r)))
               for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results == {runs[0]: True, runs[1]: True}
    assert [pg.await_run(r)[0] for r in runs] == ["cancelled", "cancelled"]


def test_a_handler_can_cancel_its_own_run(pg):
    name = define(pg)
    run = enqueue(pg, name, '{"do": "cancel_self"}')
    assert pg.await_run(run)[0] == "cancelled"
    assert root(pg, run)[:2] == ("cancelled", 1)
    # once both workers have seen the handler finish fast its commands are
    # held (nothing written before the attempt): the attempt that cancelled
    # its run is counted all the same, from the worker's shared memory
    for run in pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[40]))"):
        assert pg.await_run(run)[0] == "succeeded"
    for _ in range(4):
        run = enqueue(pg, name, '{"do": "cancel_self"}')
        assert pg.await_run(run)[0] == "cancelled"
        assert root(pg, run)[:2] == ("cancelled", 1)
        assert pg.all("SELECT attempt, outcome FROM flow.attempts WHERE run_id = %s", run) == [(1, "cancelled")]


def test_cancel_wakes_the_workers(pg):
    q = unique("one")
    pg.one(f"SELECT flow.set_queue('{q}', concurrency => 1)")
    name = define(pg, queue=f"'{q}'")
    first = enqueue(pg, name, '{"do": "sleep", "seconds": 30}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", first)
    second = enqueue(pg, name, '{"tag": "after_cancel"}')
    time.sleep(0.5)
    started = time.time()
    pg.one("SELECT flow.cancel(%s)", first)
    assert pg.await_run(second, "5s")[0] == "succeeded"
    assert time.time() - started < 3      # not the 10 s poll interval


def test_a_handler_that_ignores_cancel_is_stopped(pg):
    run = enqueue(pg, define(pg), '{"do": "stubborn"}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    time.sleep(0.3)
    started = time.time()
    assert pg.one("SELECT flow.cancel(%s)", run) is True
    assert time.time() - started < 10
    assert pg.await_run(run)[0] == "cancelled"
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")
    assert pg.await_run(enqueue(pg, define(pg)))[0] == "succeeded"


# ---------------------------------------------------------------- 3. waits

def test_spawn_with_null_waits_runs_the_child(pg):
    child = define(pg)
    run = enqueue(pg, define(pg), f'{{"do": "spawn_no_waits", "child": "{child}"}}')
    assert pg.await_run(run)[0] == "succeeded"


def test_a_wait_without_within_ends_at_the_run_deadline(pg):
    child = define(pg)
    run = enqueue(pg, define(pg), f'{{"do": "spawn_waiting", "child": "{child}"}}', deadline="'2 seconds'")
    status, _, error = pg.await_run(run, "15s")
    assert status == "failed"
    assert pg.one("SELECT stop_reason FROM flow._commands WHERE run_id = %s AND key = 'child'", run) in (
        "deadline_before_next_attempt", "attempt_limit")


# ---------------------------------------------------------------- 4. fairness

def test_queues_without_work_take_no_turns_and_batches_keep_the_interleaving(pg):
    queues = [unique(f"f{i}") for i in range(5)]
    for q in queues:
        pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    a, e = queues[0], queues[4]
    for q in (a, e):
        name = define(pg, queue=f"'{q}'")
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
    # queue's share, and the worker runs it round-robin: executor's
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


# ---------------------------------------------------------------- 5, 6. leases and locks

def test_a_heartbeat_extends_by_the_original_lease(pg):
    name = unique("ext")
    pg.one(f"SELECT flow.define('{name}', NULL)")
    pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        cmd, token = c.execute(f"SELECT command_id, lease_token FROM flow.claim(array['{name}'], 'w', 1, '2 s')"
                               ).fetchone()
        for _ in range(3):
            time.sleep(0.6)
            left = c.execute("SELECT extract(epoch FROM lease_expires_at - now()) FROM flow.heartbeat(%s, %s)",
                             (cmd, token)).fetchone()[0]
            assert 1.5 <= float(left) <= 2.1
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))


def test_a_run_locked_elsewhere_does_not_hold_up_the_batch(pg):
    q = unique("hol")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    name = define(pg, queue=f"'{q}'")
    # (keyed: a run with a row of its own, which a client holds apart from its root)
    blocked = enqueue(pg, name, '{"tag": "blocked"}', key=f"'{unique('blocked')}'")
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
    assert root(pg, blocked)[1] == 1       # handed back uncharged, then run once


# ---------------------------------------------------------------- 7. decisions

def test_a_caught_invalid_spawn_is_still_an_invalid_decision(pg):
    run = enqueue(pg, define(pg), '{"do": "bad_spawn"}')
    assert pg.await_run(run)[0] == "failed"
    assert root(pg, run)[2:] == ("permanent", "invalid_decision")


def test_a_caught_timeout_is_still_a_timeout(pg):
    run = enqueue(pg, define(pg, timeout="'300 ms'", max_attempts=1), '{"do": "swallow_timeout"}')
    assert pg.await_run(run)[0] == "failed"
    assert pg.one("SELECT outcome FROM flow.attempts WHERE run_id = %s", run) == "timeout"


# ---------------------------------------------------------------- 8. budgets

def test_the_retry_budget_starts_when_the_command_is_first_due(pg):
    tag = unique("budget")
    child = define(pg, max_elapsed="'3 s'", backoff="'100 ms'", backoff_max="'100 ms'")
    run = enqueue(pg, define(pg), f'{{"do": "spawn_for_event", "child": "{child}", "tag": "{tag}"}}')
    pg.wait_for("SELECT status = 'waiting' FROM flow._commands WHERE run_id = %s AND key = 'child'", run)
    time.sleep(3.5)    # longer than max_elapsed: waiting must not use up the budget
    pg.one("SELECT flow.emit('go', %s)", tag)
    assert pg.await_run(run)[0] == "succeeded", pg.all(
        "SELECT key, status, attempts, stop_reason, last_error_code, last_error_message, budget_started_at, created_at"
        " FROM flow._commands WHERE run_id = %s", run)
    assert pg.one("SELECT attempts FROM flow._commands WHERE run_id = %s AND key = 'child'", run) == 2


# ---------------------------------------------------------------- handler context

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


# ---------------------------------------------------------------- more classification

def attempt_outcomes(pg, run):
    return [r[0] for r in pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s ORDER BY attempt", run)]


def test_a_deadline_already_past_when_the_handler_would_start(pg):
    # the first command holds the only slot of its queue past the second's run deadline
    q = unique("late")
    pg.one(f"SELECT flow.set_queue('{q}', concurrency => 1)")
    enqueue(pg, define(pg, queue=f"'{q}'"), '{"do": "sleep", "seconds": 1.5}')
    time.sleep(0.2)
    tag = unique("late")
    run = enqueue(pg, define(pg, queue=f"'{q}'", max_attempts=1), f'{{"tag": "{tag}"}}', deadline="'1 second'")
    assert pg.await_run(run, "10s")[0] == "failed"
    assert effects(pg, tag) == 0          # the handler never ran
    assert attempt_outcomes(pg, run) == ["timeout"]


def test_pg_cancel_backend_interrupts_a_handler_and_it_is_retried(pg):
    tag = unique("pgcancel")
    run = enqueue(pg, define(pg, max_attempts=3, backoff="'10 ms'"),
                  f'{{"do": "sleep_first", "seconds": 5, "tag": "{tag}"}}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    time.sleep(0.3)
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


def test_a_rust_panic_in_a_handler_is_the_crash_class(pg):
    name = unique("panic")
    pg.one(f"SELECT flow.define('{name}', 'flow._test_panic'::regproc, max_attempts => 1)")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    assert pg.await_run(run, "10s")[0] == "failed"
    assert attempt_outcomes(pg, run) == ["crash"]
    assert pg.await_run(enqueue(pg, define(pg)), "10s")[0] == "succeeded"


# ---------------------------------------------------------------- observations

def counters(pg):
    return dict(pg.all("SELECT name, value FROM flow.stats"))


def test_counters_count_what_committed_by_outcome_stop_and_status(pg):
    before = counters(pg)
    ok, fails = define(pg), define(pg, max_attempts=1)
    retried = define(pg, backoff="'10 ms'", backoff_max="'10 ms'")
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
    name = define(pg, queue=f"'{q}'")
    slow = enqueue(pg, name, '{"do": "sleep", "seconds": 0.6}')
    quick = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[5]))")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)")
    for run in [slow, *quick]:
        assert pg.await_run(run)[0] == "succeeded"
    durations = [r[0].total_seconds() for r in pg.all(
        "SELECT duration FROM flow.attempts WHERE run_id = ANY(%s::uuid[])", quick)]
    assert len(durations) == 5 and max(durations) < 0.3, durations
    assert pg.one("SELECT duration FROM flow.attempts WHERE run_id = %s", slow).total_seconds() >= 0.6


# ---------------------------------------------------------------- typed arguments

def test_args_are_checked_against_the_definitions_args_type(pg):
    pg.all("CREATE TYPE app.order_args AS (order_id int, sku text)")
    pg.all("CREATE DOMAIN app.has_x AS jsonb CHECK (VALUE ? 'x')")
    name, loose = unique("typed"), unique("loose")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, args_type => 'app.order_args')")
    pg.one(f"SELECT flow.define('{loose}', 'flow.noop'::regproc, args_type => 'app.has_x')")
    assert pg.await_run(pg.one(f"""SELECT flow.enqueue('{name}', '{{"order_id": 7, "sku": "book"}}')"""))[0] == \
        "succeeded"
    before = pg.one("SELECT count(*) FROM flow._run_rows")
    for bad in ['{"order_id": "seven"}', '{"order_id": 7, "colour": "red"}']:
        assert pg.sqlstate(f"SELECT flow.enqueue('{name}', '{bad}')") == "FL019"
    assert pg.sqlstate(f"""SELECT flow.enqueue_many('{name}', array['{{"order_id": 1}}', '{{"order_id": "x"}}']::jsonb[])""") == "FL019"
    assert pg.sqlstate(f"SELECT flow.enqueue('{loose}', '{{\"y\": 1}}')") == "FL019"
    assert pg.one("SELECT count(*) FROM flow._run_rows") == before
    assert pg.sqlstate(f"SELECT flow.define('{unique('n')}', 'flow.noop'::regproc, args_type => 'integer')") == "FL015"


def test_args_are_checked_as_they_are(pg):
    """The args_type check sees the args exactly (not through doubles): a
    price of 1.10 has two decimal places, at enqueue and again before the
    attempt."""
    pg.all("CREATE DOMAIN app.cents AS numeric CHECK (scale(VALUE) = 2)")
    pg.all("CREATE TYPE app.priced AS (price app.cents)")
    name = unique("priced")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, args_type => 'app.priced')")
    assert pg.await_run(pg.one(f"""SELECT flow.enqueue('{name}', '{{"price": 1.10}}')"""))[0] == "succeeded"
    assert pg.sqlstate(f"""SELECT flow.enqueue('{name}', '{{"price": 1.1}}')""") == "FL019"


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
