"""flow.cancel: of a pending run, of a running handler (leased or held, one
that ignores it, one that cancels its own run), of a workflow's waiting
children, of runs whose commands external workers hold or lease, against
concurrent cancels, completions, heartbeats and retention; and what a cancel
signals never lands on another run's handler. (Claim vs cancel, step by
step: isolation/specs/claim_vs_cancel.spec, run by test_isolation.py.)"""
import threading
import time

import psycopg
import pytest

from conftest import (ACT, ACT_APP, ENGINE_APP, EXTERNAL_APP, QUICK, WORKFLOW_APP, app_cluster, barrier, claim,
                      command, command_attempts, command_row, commands, define, enqueue, external, hold,
                      hold_or_none, poll, root, seen_fast, unique)


@pytest.fixture(scope="module")
def pg():
    """A long poll interval: anything that is quick here was woken, not
    polled. The engine's handlers, app.act, the workflows' definitions
    ('doomed', 'leaf', ...), roles alice and bob."""
    cluster = app_cluster(ENGINE_APP, ACT_APP, WORKFLOW_APP, EXTERNAL_APP,
                          conf=("flow.workers = 2", "flow.poll_interval = '10s'"))
    yield cluster
    cluster.stop()


# ---------------------------------------------------------------- a run's own commands

def test_cancel_a_pending_run(app):
    name = define(app, "app.hello")
    run = enqueue(app, name, start_after="'1 hour'")
    assert app.one("SELECT flow.cancel(%s)", run) is True
    assert command(app, run)[0] == "cancelled"


def test_cancel_a_running_command_discards_its_writes(app):
    name = define(app, "app.decides")
    run = enqueue(app, name, '{"do": "sleep", "seconds": 1.5, "tag": "cancelme"}')
    app.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    assert app.one("SELECT flow.cancel(%s)", run) is True
    assert app.one("SELECT flow.cancel(%s)", run) is False
    assert app.await_run(run, "1s")[0] == "cancelled"
    time.sleep(2.0)   # (time itself: past the handler's 1.5 s, nothing of it commits)
    assert command(app, run)[0] == "cancelled"
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'cancelme'") == 0
    assert app.one("SELECT status FROM flow.runs WHERE id = %s", run) == "cancelled"


def test_cancel_on_the_last_attempt_ends_the_run_cancelled(pg):
    run = enqueue(pg, define(pg, ACT, max_attempts=1), '{"do": "sleep", "seconds": 3}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    pg.wait_handler_sleeping(run)
    assert pg.one("SELECT flow.cancel(%s)", run) is True
    assert pg.await_run(run)[0] == "cancelled"
    assert root(pg, run)[0] == "cancelled"


def test_a_cancel_that_rolls_back_leaves_nothing_stuck(pg):
    tag = unique("rb")
    run = enqueue(pg, define(pg, ACT), f'{{"do": "sleep_first", "seconds": 2, "tag": "{tag}"}}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    pg.wait_handler_sleeping(run)
    with pg.connect(autocommit=False) as c:
        assert c.execute("SELECT flow.cancel(%s)", (run,)).fetchone()[0] is True
        c.rollback()
    # the handed-back command runs again and the run finishes
    assert pg.await_run(run)[0] == "succeeded"
    assert root(pg, run)[0] == "succeeded"


def test_concurrent_cancels_each_end_their_run(pg):
    name = define(pg, ACT)
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
    name = define(pg, ACT)
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
    name = define(pg, ACT, queue=f"'{q}'")
    first = enqueue(pg, name, '{"do": "sleep", "seconds": 30}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", first)
    second = enqueue(pg, name, '{"tag": "after_cancel"}')
    pg.wait_workers_asleep(1)   # (the other worker, its queue full: asleep until woken, or 10 s)
    started = time.time()
    pg.one("SELECT flow.cancel(%s)", first)
    assert pg.await_run(second, "5s")[0] == "succeeded"
    assert time.time() - started < 3      # not the 10 s poll interval


# ---------------------------------------------------------------- held attempts (run in the claim's transaction)

def test_a_held_attempt_shows_as_running_and_is_cancelled_like_a_leased_one(app):
    """Once the workers have seen a handler finish fast, its commands are held
    (run in the claim's transaction, nothing written before): the views still
    show the attempt running, and a cancel still discards its writes."""
    name = define(app, "app.decides")
    seen_fast(app, name)
    run = enqueue(app, name, '{"do": "sleep", "seconds": 1.5, "tag": "held"}')
    app.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    # held: the table still says pending, the views say what happens
    assert app.one("SELECT status FROM flow._commands WHERE run_id = %s", run) == "pending"
    assert app.all("SELECT attempts, lease_owner IS NOT NULL, attempt_started_at IS NOT NULL"
                   " FROM flow.commands WHERE run_id = %s", run) == [(1, True, True)]
    assert app.one("SELECT outcome FROM flow.attempts WHERE run_id = %s", run) == "running"
    assert app.one("SELECT count(*) FROM flow.workers WHERE command_id = (SELECT id FROM flow.commands"
                   " WHERE run_id = %s)", run) == 1
    assert app.one("SELECT flow.cancel(%s)", run) is True
    assert app.await_run(run, "5s")[0] == "cancelled"
    assert command(app, run)[0] == "cancelled"
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'held'") == 0
    # every attempt that started is counted, none charged: the held one cut
    # by the cancel (or at its fast budget) voided, a leased one cancelled
    outcomes = app.all("SELECT outcome, error_code FROM flow.attempts WHERE run_id = %s ORDER BY attempt", run)
    assert outcomes and all(o == ("voided", "cancelled") or o == ("voided", "demoted") or o[0] == "cancelled"
                            for o in outcomes), outcomes


def test_a_cancel_interrupts_a_held_handler_at_once(app):
    """A cancel finds the worker that runs a held handler of the run (from
    the worker's own note of what it runs, read without a lock) and
    interrupts it: the cancel returns and the run ends long before the
    handler's 5 s would have."""
    name = define(app, "app.decides")
    seen_fast(app, name)
    run = enqueue(app, name, '{"do": "sleep", "seconds": 5, "tag": "held_interrupted"}')
    app.wait_for("SELECT count(*) = 1 FROM flow.workers WHERE state = 'busy' AND command_id ="
                 " (SELECT id FROM flow.commands WHERE run_id = %s)", run)
    assert app.one("SELECT status FROM flow._commands WHERE run_id = %s", run) == "pending"   # held
    started = time.monotonic()
    assert app.one("SELECT flow.cancel(%s)", run) is True
    assert app.await_run(run, "3s")[0] == "cancelled"
    assert time.monotonic() - started < 3.0
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'held_interrupted'") == 0
    app.wait_for("SELECT count(*) = 0 FROM flow.workers WHERE command_id IS NOT NULL")


def test_a_cancel_while_a_failed_chunk_is_counted_counts_its_started_attempt(app):
    """A held chunk that fails outside its handlers rolls back the attempts
    it started, and its worker counts them (voided) in a transaction of its
    own. A cancel that takes the run in between still finds the attempt in
    the worker's record and counts it (rule 3); it used to close the command
    with no attempt counted. (chunk_failed:stall holds that moment open.)"""
    name = define(app, "app.decides")
    seen_fast(app, name)
    failures = app.log().count("fault injected at settle_success")
    app.configure("flow.fault_points", "settle_success:error, chunk_failed:stall", settle=0.3)
    try:
        run = enqueue(app, name, '{"tag": "contained"}')
        poll(lambda: app.log().count("fault injected at settle_success") > failures,
             what="the held chunk failed at its settlement")
        assert app.one("SELECT flow.cancel(%s)", run) is True
    finally:
        app.configure("flow.fault_points", settle=0.3)
    assert app.await_run(run, "5s")[0] == "cancelled"
    cmd = app.one("SELECT id FROM flow.commands WHERE run_id = %s", run)
    assert command_row(app, cmd)[:2] == ("cancelled", 1)
    assert [a[:2] for a in command_attempts(app, cmd)] == [(1, "cancelled")]
    assert app.one("SELECT count(*) FROM app.effects WHERE run_key = 'contained'") == 0


def test_a_handler_that_ignores_cancel_is_stopped(pg):
    run = enqueue(pg, define(pg, ACT), '{"do": "stubborn"}')
    pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", run)
    pg.wait_handler_sleeping(run)
    started = time.time()
    assert pg.one("SELECT flow.cancel(%s)", run) is True
    assert time.time() - started < 10
    assert pg.await_run(run)[0] == "cancelled"
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")
    assert pg.await_run(enqueue(pg, define(pg, ACT)))[0] == "succeeded"


# ---------------------------------------------------------------- workflows

def test_cancel_cancels_waiting_children_and_nothing_runs_after(pg):
    run = pg.one("SELECT flow.enqueue('doomed', '{\"fail_after\": \"1 hour\"}')")
    pg.wait_for("SELECT count(*) = 4 FROM flow.commands WHERE run_id = %s", run)
    pg.wait_for("SELECT status = 'succeeded' FROM flow.commands WHERE run_id = %s AND key = 'root'", run)
    assert pg.one("SELECT flow.cancel(%s)", run) is True
    assert commands(pg, run) == {"root": "succeeded", "bad": "cancelled", "waits": "cancelled",
                                 "later": "cancelled"}
    pg.one("SELECT flow.emit('never', 'x')")
    time.sleep(0.5)   # (time itself: nothing of the run runs after it)
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s", run) == 0
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "cancelled"


# ---------------------------------------------------------------- other roles

def test_a_cancel_never_lands_on_another_roles_handler(pg):
    """flow.cancel signals the worker running the cancelled run's handler; a
    signal that arrives after that handler ended is not charged to the next
    one (another role's): it is given back and runs again, uncharged."""
    pg.all("""
        CREATE OR REPLACE FUNCTION app.bob_naps(args jsonb) RETURNS void LANGUAGE sql AS $$ SELECT pg_sleep(0.01) $$;
        ALTER FUNCTION app.bob_naps(jsonb) OWNER TO bob;
        CREATE OR REPLACE FUNCTION app.alice_naps(args jsonb) RETURNS void LANGUAGE sql AS $$ SELECT pg_sleep(0.01) $$;
        ALTER FUNCTION app.alice_naps(jsonb) OWNER TO alice;
    """)
    b, a = unique("bnap"), unique("anap")
    pg.one(f"SELECT flow.define('{b}', 'app.bob_naps'::regproc)", user="bob")
    pg.one(f"SELECT flow.define('{a}', 'app.alice_naps'::regproc)", user="alice")
    bobs = pg.one(f"SELECT flow.enqueue_many('{b}', array_fill('{{}}'::jsonb, array[300]))", user="bob")
    alices = pg.one(f"SELECT flow.enqueue_many('{a}', array_fill('{{}}'::jsonb, array[300]))", user="alice")
    with pg.connect("bob") as c:
        for run in bobs:
            c.execute("SELECT flow.cancel(%s)", (run,))
    for run in alices:
        assert pg.await_run(run, "60s", user="alice")[0] == "succeeded"
    assert pg.one("SELECT count(*) FROM flow.attempts WHERE run_id = ANY (%s) AND outcome <> 'succeeded'",
                  alices, user="alice") == 0


# ---------------------------------------------------------------- external workers

def test_heartbeat_says_when_the_run_was_cancelled(pg):
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        pg.one("SELECT flow.cancel(%s)", run)
        assert c.execute("SELECT cancelled FROM flow.heartbeat(%s, %s)", (cmd, token)).fetchone()[0] is True
        with pytest.raises(psycopg.Error) as caught:
            c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
        assert caught.value.sqlstate == "FL013"
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "cancelled"


def test_a_heartbeat_waiting_for_a_cancel_says_cancelled(pg):
    """A heartbeat that waits for the run's lock while a cancel holds it
    returns cancelled = true once the cancel commits, as one made after it
    does (it raised FL013, 'claim the command again')."""
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
    with pg.connect(autocommit=False) as cancelling:
        assert cancelling.execute("SELECT flow.cancel(%s)", (run,)).fetchone()[0] is True
        beat = pg.waiting_call("SELECT * FROM flow.heartbeat(%s, %s)", (cmd, token), "%flow.heartbeat%")
        cancelling.commit()
    assert beat() == [(None, True)]
    assert pg.all("SELECT * FROM flow.heartbeat(%s, %s)", cmd, token) == [(None, True)]


def test_completing_a_root_with_no_child_takes_no_run_lock_and_a_cancel_waits_for_it(pg):
    """complete_many of a run's only command writes that command alone and does
    not lock the run; a cancel that comes meanwhile takes the run, then waits
    for the command, and finds the run ended (false), not cancelled. (A keyed
    run: it has a row of its own to lock apart from its root; a run without
    a row is locked by its root's row, see sql/schema.sql.)"""
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}', key => '{unique('alone')}')")
    with pg.connect(autocommit=False) as c, pg.connect() as canceller:
        [(cmd, token, *_)] = claim(c, name)
        c.commit()
        with pg.connect(autocommit=False) as other:
            other.execute("SELECT 1 FROM flow._runs WHERE id = %s FOR UPDATE", (run,))
            c.execute("SET LOCAL lock_timeout = '2s'")
            assert c.execute("SELECT status FROM flow.complete_many(%s, %s)", ([cmd], [token])).fetchall() \
                == [("succeeded",)]
            other.rollback()
        # the completion is not committed yet: the cancel waits for it
        outcome = []
        waiter = threading.Thread(target=lambda: outcome.append(
            canceller.execute("SELECT flow.cancel(%s)", (run,)).fetchone()[0]))
        waiter.start()
        pg.wait_for("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                    canceller.info.backend_pid)
        assert outcome == []
        c.commit()
        waiter.join(10)
    assert outcome == [False]
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
    assert pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s", run) == [("succeeded",)]


@pytest.mark.parametrize("holder_ends", ["completes", "rolls_back"])
def test_a_cancel_waits_for_the_transaction_holding_the_command(pg, holder_ends):
    """flow.cancel of a run whose command is held waits for the holder: if it
    completed, the run finished and the cancel returns false; if it rolled
    back, the cancel goes on (true) and the run is cancelled."""
    name = external(pg, **QUICK)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect(autocommit=False) as c:
        [(cmd, token, _, _)] = hold(c, name)
        cancel = pg.waiting_call("SELECT flow.cancel(%s)", (run,), "%flow.cancel%")
        if holder_ends == "completes":
            assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([cmd], [token])).fetchall() == \
                [(cmd, "succeeded")]
            c.commit()
        else:
            c.rollback()
    if holder_ends == "completes":
        assert cancel() == [(False,)]
        assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
        assert command_row(pg, cmd) == ("succeeded", 1, "w", None)
    else:
        assert cancel() == [(True,)]
        barrier(pg)
        assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "cancelled"
        # counted if worker 0 concluded it before the cancel took the row; never revived
        status, count, _, reason = command_row(pg, cmd)
        assert (status, reason) == ("cancelled", "cancelled")
        assert command_attempts(pg, cmd) == [(1, "interrupted", "transaction_ended", "w")][:count]
        with pg.connect() as c:
            assert hold_or_none(c, name) == []


def test_cancels_racing_completions_never_cancel_a_run_that_ended(pg):
    """Cancels racing the settlements of small workflows (a root that spawns
    a part and a join): each cancel says true and the run is cancelled with
    something of it cancelled, or it says false and the run succeeded. (0.2.0
    waited for the root's command without holding the run's row the root's
    chunk had just made, and its final update did not check the run was
    still running: 0-5 of 3,000 succeeded runs became cancelled, or the
    cancel failed with 23514.)"""
    runs = pg.one("SELECT flow.enqueue_many('fan_root', array_fill('{\"n\": 1}'::jsonb, array[400]))")
    outcomes, errors = {}, []

    def cancel(share):
        with pg.connect() as c:
            for i, run in enumerate(share):
                time.sleep((i % 7) * 0.0005)   # (spread over the runs' settlements)
                try:
                    outcomes[run] = c.execute("SELECT flow.cancel(%s)", (run,)).fetchone()[0]
                except psycopg.Error as e:
                    errors.append((run, e.sqlstate, str(e)))

    threads = [threading.Thread(target=cancel, args=(runs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    for run in runs:
        pg.await_run(run, "30s")
    status = dict(pg.all("SELECT id, status FROM flow.runs WHERE id = ANY(%s)", runs))
    cancelled_parts = dict(pg.all("SELECT run_id, count(*) FILTER (WHERE status = 'cancelled') FROM flow.commands"
                                  " WHERE run_id = ANY(%s) GROUP BY run_id", runs))
    wrong = [(run, outcomes[run], status[run], cancelled_parts[run]) for run in runs
             if (outcomes[run], status[run]) not in ((True, "cancelled"), (False, "succeeded"))
             or (status[run] == "cancelled") != (cancelled_parts[run] > 0)]
    assert wrong == []


# ---------------------------------------------------------------- retention (last in this module: the pruning deletes every run it finished)

def test_cancel_of_a_run_retention_deletes_meanwhile_says_false(pg):
    """A cancel that waits for a finished run's lock while retention deletes
    it returns false and counts nothing, as for any run that ended (it
    returned true and counted a cancel). Last in this module: the pruning
    deletes every run it finished."""
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}', '{{}}', key => 'k1')")   # keyed: a run row of its own
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
    counted = "SELECT value FROM flow.stats WHERE name = 'runs_cancelled'"
    before = pg.one(counted)
    with pg.connect(autocommit=False) as pruning:
        assert pruning.execute("SELECT pruned FROM flow._prune('0 s', 100000, NULL)").fetchone()[0] >= 1
        cancel = pg.waiting_call("SELECT flow.cancel(%s)", (run,), "%flow.cancel%")
        pruning.commit()
    assert cancel() == [(False,)]
    assert pg.one("SELECT count(*) FROM flow._run_rows WHERE id = %s", run) == 0
    assert pg.one(counted) == before
