"""External workers: claim and resolve commands from outside the server under a lease."""
import threading
import time
import uuid

import psycopg
import pytest

from conftest import define_external, external_workers_cluster, spread_over_two_queues, unique


@pytest.fixture(scope="module")
def pg():
    cluster = external_workers_cluster()
    yield cluster
    cluster.stop()


def external(pg, user="postgres", **kw):
    return define_external(pg, "ext", user, **kw)


def claim(conn, name, worker="w", max_=1, lease="30 s"):
    return conn.execute("SELECT command_id, lease_token, args, attempt, context FROM flow.claim(%s, %s, %s, %s)",
                        ([name], worker, max_, lease)).fetchall()


def test_in_database_workers_never_run_external_definitions(pg):
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    time.sleep(0.5)
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s", run) == "pending"


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
        time.sleep(0.5)
        assert outcome == []
        c.commit()
        waiter.join(10)
    assert outcome == [False]
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
    assert pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s", run) == [("succeeded",)]


def test_complete_many_of_spawned_commands_takes_their_runs_lock_and_ends_the_run_with_the_last(pg):
    """Commands spawned in a run are settled under the run's lock (rule 7):
    complete_many waits for it (here: times out while another session holds
    it, changing nothing), then settles them, and the last one ends the run."""
    root, child = external(pg), external(pg)
    run = pg.one(f"SELECT flow.enqueue('{root}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, root)
        children = psycopg.types.json.Jsonb([{"name": child, "key": "a"}, {"name": child, "key": "b"}])
        c.execute("SELECT flow.complete(%s, %s, '{\"root\": 2}', NULL, %s)", (cmd, token, children))
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "running"
    with pg.connect(autocommit=False) as c, pg.connect(autocommit=False) as other:
        rows = claim(c, child, max_=2)
        assert len(rows) == 2
        c.commit()
        other.execute("SELECT 1 FROM flow._runs WHERE id = %s FOR UPDATE", (run,))
        c.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([r[0] for r in rows], [r[1] for r in rows]))
        c.rollback()
        other.rollback()
        assert c.execute("SELECT status FROM flow.complete_many(%s, %s)",
                         ([r[0] for r in rows], [r[1] for r in rows])).fetchall() == [("succeeded",)] * 2
        c.commit()
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
    assert pg.one("SELECT result FROM flow.runs WHERE id = %s", run) == {"root": 2}
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = %s AND status = 'succeeded'", run) == 3


def test_a_claim_of_no_command_takes_nothing_from_a_due_backlog(pg):
    """flow._claim with max_count 0 runs its statements and takes nothing:
    an idle worker claims so to plan them again after an ANALYZE or a
    TRUNCATE (executor::warm_plans), while commands may be due."""
    name = unique("warm")
    pg.one(f"SELECT flow.define('{name}', NULL)")
    pg.one(f"SELECT cardinality(flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[3])))")
    pg.all("ANALYZE flow._commands")
    assert pg.one(f"SELECT count(*) FROM flow._claim(0, array['{name}'], 0)") == 0
    assert pg.one(f"SELECT count(*) FROM flow._commands WHERE name = '{name}'"
                  " AND status = 'pending' AND attempts = 0 AND lease_token IS NULL") == 3
    with pg.connect() as c:
        assert len(c.execute(f"SELECT 1 FROM flow.claim(array['{name}'], 'test', 10)").fetchall()) == 3


def test_commands_left_behind_where_claims_take_up_are_claimed_by_the_next_short_claim(pg):
    """A claim of one definition takes up where the last full claim of it
    ended (flow.claim): commands behind that point that are due again (here,
    a full claim rolled back) are taken once a claim from there comes back
    short, in the same call: every command is claimed once, none is left."""
    name = external(pg)
    pg.one(f"SELECT cardinality(flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[300])))")
    with pg.connect() as c, pg.connect() as undone:
        first = claim(c, name, max_=100)
        undone.execute("BEGIN")
        rolled_back = claim(undone, name, max_=100)
        undone.execute("ROLLBACK")
        third = claim(c, name, max_=100)
        # from where the rolled-back claim ended: nothing; then from the head
        fourth = claim(c, name, max_=150)
        assert claim(c, name, max_=100) == []
    assert [len(x) for x in (first, rolled_back, third, fourth)] == [100, 100, 100, 100]
    ids = lambda rows: {r[0] for r in rows}
    assert ids(fourth) == ids(rolled_back)
    assert len(ids(first) | ids(third) | ids(fourth)) == 300
    assert pg.one(f"SELECT count(*) FROM flow.commands WHERE name = '{name}' AND status = 'running'") == 300


def test_a_claim_from_several_queues_and_definitions_gets_its_max_and_locks_only_that(pg):
    """A claim reads each queue's share for each definition it names, then the
    rest from those that have more: it gets its max while that many are due,
    interleaved, and locks no command it does not take (one locked and left
    out stayed locked for the client's transaction, skipped by other claims)."""
    first, second, queues = spread_over_two_queues(pg, external)
    with pg.connect(autocommit=False) as c:
        rows = c.execute("SELECT name, queue FROM flow.claim(%s, 'w', 8)", ([first, second],)).fetchall()
        taken = {(n, q): rows.count((n, q)) for n, q in set(rows)}
        # 2 each of its 4 shares, the lone command and both of second's in
        # queues[0]; the rest (3) of first's in queues[0]
        assert taken == {(first, queues[0]): 5, (first, queues[1]): 1, (second, queues[0]): 2}, taken
        free = pg.one("SELECT count(*) FROM (SELECT 1 FROM flow._commands WHERE name = ANY (%s)"
                      " FOR UPDATE SKIP LOCKED) c", [first, second])
        assert free == 13 - 8, free
        c.rollback()
    with pg.connect() as c:
        assert len(c.execute("SELECT 1 FROM flow.claim(%s, 'w', 100)", ([first, second],)).fetchall()) == 13


def test_claim_complete_round_trip(pg):
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"x\": 1}}')")
    with pg.connect() as c:
        [(cmd, token, args, attempt, context)] = claim(c, name)
        assert args == {"x": 1} and attempt == 1
        assert pg.one("SELECT status FROM flow.commands WHERE id = %s", cmd) == "running"
        expires, cancelled = c.execute("SELECT * FROM flow.heartbeat(%s, %s, '1 minute')", (cmd, token)).fetchone()
        assert cancelled is False
        assert c.execute("SELECT %s > now() + interval '50 s'", (expires,)).fetchone()[0]
        assert c.execute("SELECT flow.complete(%s, %s, '{\"done\": true}')", (cmd, token)).fetchone()[0] == "succeeded"
    assert pg.await_run(run, "5s") == ("succeeded", {"done": True}, None)


def test_ten_claimers_five_thousand_commands_exactly_once(pg):
    name = external(pg)
    pg.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('i', i)))"
           " FROM generate_series(1, 5000) i")
    seen, errors = [], []
    lock = threading.Lock()

    def work(n):
        try:
            with pg.connect() as c:
                while True:
                    rows = claim(c, name, worker=f"w{n}", max_=25)
                    if not rows:
                        break
                    if n % 2:
                        with c.transaction():
                            for cmd, token, args, _, _ in rows:
                                c.execute("SELECT flow.complete(%s, %s, %s)",
                                          (cmd, token, psycopg.types.json.Jsonb(args)))
                    else:
                        statuses = c.execute(
                            "SELECT status FROM flow.complete_many(%s, %s, %s::jsonb[])",
                            ([r[0] for r in rows], [r[1] for r in rows],
                             [psycopg.types.json.Jsonb(r[2]) for r in rows])).fetchall()
                        assert statuses == [("succeeded",)] * len(rows)
                    with lock:
                        seen.extend(r[0] for r in rows)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(10)]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    assert not errors, errors[:3]
    assert len(seen) == 5000 and len(set(seen)) == 5000
    assert pg.one("SELECT count(*) FROM flow.commands WHERE name = %s AND status = 'succeeded' AND attempts = 1",
                  name) == 5000


def test_a_lost_lease_is_retried_and_the_stale_complete_changes_nothing(pg):
    name = external(pg, max_attempts=3, backoff="'10 ms'")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, stale, *_)] = claim(c, name, worker="slow", lease="300 ms")
        time.sleep(0.6)
        # the lease expired by the database clock: it is concluded as lease_lost
        # and retried after its backoff (10 ms)
        for _ in range(40):
            rows = claim(c, name, worker="fast")
            if rows:
                break
            time.sleep(0.05)
        [(cmd2, fresh, _, attempt, _)] = rows
        assert cmd2 == cmd and attempt == 2 and fresh != stale
        with pytest.raises(psycopg.Error) as caught:
            c.execute("SELECT flow.complete(%s, %s, '{\"late\": true}')", (cmd, stale))
        assert caught.value.sqlstate == "FL013"
        assert c.execute("SELECT flow.complete(%s, %s, '{\"fresh\": true}')", (cmd, fresh)).fetchone()[0] == "succeeded"
    assert pg.await_run(run, "5s") == ("succeeded", {"fresh": True}, None)
    assert pg.all("SELECT attempt, outcome, owner FROM flow.attempts WHERE run_id = %s ORDER BY attempt", run) == \
        [(1, "lease_lost", "slow"), (2, "succeeded", "fast")]


def test_expired_leases_are_recovered_by_the_workers_too(pg):
    name = external(pg, max_attempts=1)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        claim(c, name, lease="200 ms")
    status, _, error = pg.await_run(run, "10s")
    assert status == "failed" and error["code"] == "lease_lost" and error["stop_reason"] == "attempt_limit"


def test_complete_with_events_and_children_drives_a_workflow(pg):
    name = external(pg)
    key = unique("order")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        children = psycopg.types.json.Jsonb([
            {"name": "in_db_child", "key": "after", "waits": [{"name": "paid", "key": key}], "within": "1 minute"},
            {"name": "in_db_child", "key": "now", "args": {"a": 1}},
        ])
        events = psycopg.types.json.Jsonb([{"name": "paid", "key": key, "payload": {"amount": 5}}])
        c.execute("SELECT flow.complete(%s, %s, '{\"root\": 1}', %s, %s)", (cmd, token, events, children))
    assert pg.await_run(run, "10s") == ("succeeded", {"root": 1}, None)
    after = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'after'", run)
    assert after["inputs"][0]["payload"] == {"amount": 5}
    assert sorted(r[0] for r in pg.all("SELECT key FROM app.effects WHERE run_id = %s", run)) == ["after", "now"]


def test_fail_applies_the_retry_policy(pg):
    name = external(pg, max_attempts=3, backoff="'1 hour'", backoff_max="'2 hours'")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        assert c.execute("SELECT flow.fail(%s, %s, 'rate limited', retry_after => '200 ms')",
                         (cmd, token)).fetchone()[0] == "retry"
        assert claim(c, name) == []
        time.sleep(0.3)
        [(cmd, token, _, attempt, _)] = claim(c, name)
        assert attempt == 2
        assert c.execute("SELECT flow.fail(%s, %s, 'bad card', permanent => true)", (cmd, token)).fetchone()[0] == "failed"
    status, _, error = pg.await_run(run, "5s")
    assert status == "failed" and error["message"] == "bad card" and error["stop_reason"] == "permanent"


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


def state(pg):
    # finished attempts (a success is its command row: see sql/schema.sql), events, running commands
    return pg.all("SELECT (SELECT count(*) FROM flow.attempts WHERE outcome <> 'running'), (SELECT count(*) FROM flow._events),"
                  " (SELECT count(*) FROM flow._commands WHERE status = 'running')")[0]


def test_bad_resolutions_change_nothing(pg):
    name = external(pg)
    pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        before = state(pg)
        bad = [
            ("SELECT flow.complete(%s, gen_random_uuid())", (cmd,), "FL013"),
            ("SELECT flow.complete(gen_random_uuid(), %s)", (token,), "FL014"),
            ("SELECT flow.fail(%s, %s, 'x', retry_after => '-1 s')", (cmd, token), "FL005"),
            ("SELECT flow.fail(%s, %s, 'x', retry_after => '0 s')", (cmd, token), "FL005"),
            ("SELECT flow.complete(%s, %s, jsonb_build_object('big', repeat('x', 300000)))", (cmd, token), "FL004"),
            ("SELECT flow.complete(%s, %s, NULL, '{\"not\": \"an array\"}')", (cmd, token), "FL003"),
            ("SELECT flow.complete(%s, %s, NULL, '[{\"name\": null, \"key\": \"k\"}]')", (cmd, token), "FL002"),
            ("SELECT flow.heartbeat(%s, gen_random_uuid())", (cmd,), "FL013"),
            ("SELECT flow.heartbeat(%s, %s, '-1 s')", (cmd, token), "FL005"),
            ("SELECT * FROM flow.claim(array['no_such'], 'w')", (), "FL001"),
            ("SELECT * FROM flow.claim(%s, 'w', 0)", ([name],), "FL015"),
            ("SELECT * FROM flow.claim(%s, 'w', 1, '-1 s')", ([name],), "FL005"),
            ("SELECT * FROM flow.claim(%s, '')", ([name],), "FL002"),
        ]
        for query, args, code in bad:
            with pytest.raises(psycopg.Error) as caught:
                c.execute(query, args)
            assert caught.value.sqlstate == code, query
            assert state(pg) == before, query
        assert c.execute("SELECT flow.complete(%s, %s)", (cmd, token)).fetchone()[0] == "succeeded"
        after = state(pg)
        with pytest.raises(psycopg.Error) as caught:
            c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
        assert caught.value.sqlstate == "FL017"  # double completion
        assert state(pg) == after


def test_a_role_resolves_only_its_own_definitions(pg):
    name = external(pg, user="alice")
    run = pg.one(f"SELECT flow.enqueue('{name}')", user="alice")
    assert pg.sqlstate("SELECT * FROM flow.claim(%s, 'w')", [name], user="bob") == "FL001"
    with pg.connect("alice") as c:
        [(cmd, token, *_)] = claim(c, name)
    assert pg.sqlstate("SELECT flow.complete(%s, %s)", cmd, token, user="bob") == "FL014"
    assert pg.sqlstate("SELECT flow.fail(%s, %s, 'x')", cmd, token, user="bob") == "FL014"
    with pg.connect("alice") as c:
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
    assert pg.await_run(run, "5s", user="alice")[0] == "succeeded"


def test_complete_many_settles_what_it_holds_and_reports_the_rest(pg):
    name = external(pg, max_attempts=3, backoff="'1 hour'", backoff_max="'2 hours'")
    runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[3]))")
    with pg.connect() as c:
        rows = claim(c, name, max_=3)
        (a, ta, *_), (b, tb, *_), (d, td, *_) = rows
        c.execute("SELECT flow.complete(%s, %s)", (a, ta))                     # a: completed already
        before = state(pg)
        out = dict(c.execute("SELECT * FROM flow.complete_many(%s, %s, %s::jsonb[])",
                             ([a, b, d], [ta, tb, uuid.UUID(int=0)],
                              ['{"r": 1}', '{"r": 2}', '{"r": 3}'])).fetchall())
        assert out == {a: "already_completed", b: "succeeded", d: "lease_lost"}
        assert pg.one("SELECT result FROM flow.commands WHERE id = %s", b) == {"r": 2}
        assert pg.one("SELECT status FROM flow.commands WHERE id = %s", d) == "running"
        assert state(pg)[0] == before[0] + 1  # one more finished attempt: b's
        with pytest.raises(psycopg.Error) as caught:
            c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([d], [td, td]))
        assert caught.value.sqlstate == "FL003"
    assert pg.sqlstate("SELECT * FROM flow.complete_many(%s, %s)", [d], [td], user="bob") == "FL014"
    assert sorted(pg.one("SELECT array_agg(status::text) FROM flow.runs WHERE id = ANY(%s)", runs)) == \
        ["running", "succeeded", "succeeded"]


def test_complete_many_after_the_lease_ran_out_settles_nothing(pg):
    """A lease that ran out by the database clock settles nothing, whether or
    not its attempt was concluded yet: the command is reported lease_lost
    and goes on to its retry."""
    name = external(pg, max_attempts=3, backoff="'1 hour'", backoff_max="'2 hours'")
    pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name, lease="300 ms")
        time.sleep(0.4)
        out = c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([cmd], [token])).fetchall()
    assert out == [(cmd, "lease_lost")]
    assert pg.one("SELECT status FROM flow.commands WHERE id = %s", cmd) in ("running", "pending")
    assert pg.one("SELECT count(*) FROM flow.attempts WHERE command_id = %s AND outcome = 'succeeded'", cmd) == 0


def test_complete_many_reports_succeeded_only_for_what_it_settled(pg):
    """complete_many reads the commands without a lock: one that moves on
    before its settlement locks it is not settled, and is reported as it
    then is. A cancel committed meanwhile: lease_lost (it was reported
    succeeded, with the run cancelled and the result dropped); the same
    completion made meanwhile by another call: already_completed; the
    others of the call are settled."""
    name = external(pg)
    cancelled_run, *_ = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[3]))")
    with pg.connect() as c:
        rows = claim(c, name, max_=3)
    (a, ta, *_), (b, tb, *_), (d, td, *_) = sorted(rows, key=lambda r: r[0] != cancelled_run)
    assert a == cancelled_run   # a run's only command has the run's id
    with pg.connect(autocommit=False) as holder:
        assert holder.execute("SELECT flow.cancel(%s)", (a,)).fetchone()[0] is True
        assert holder.execute("SELECT * FROM flow.complete_many(%s, %s)", ([b], [tb])).fetchall() == \
            [(b, "succeeded")]
        outcomes = pg.waiting_call("SELECT * FROM flow.complete_many(%s, %s)", ([a, b, d], [ta, tb, td]),
                                "%complete_many%")
        holder.commit()
    assert dict(outcomes()) == {a: "lease_lost", b: "already_completed", d: "succeeded"}
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", a) == "cancelled"
    assert pg.all("SELECT status::text, result FROM flow.commands WHERE id = %s", a) == [("cancelled", None)]
    assert pg.all("SELECT status::text FROM flow.commands WHERE id = ANY (%s) ORDER BY status", [b, d]) == \
        [("succeeded",), ("succeeded",)]
    assert pg.one("SELECT count(*) FROM flow.attempts WHERE command_id = %s AND outcome = 'succeeded'", a) == 0


def test_a_lease_extended_while_a_claim_concludes_expired_leases_stands(pg):
    """A claim concludes the expired leases of its definitions first, read
    before it locks each: a heartbeat that extended one meanwhile (it was not
    expired by its own transaction's clock) has told its worker the lease
    holds, and the claim leaves it (it concluded it lease_lost: with one
    attempt allowed, the run failed under a worker told to go on)."""
    name = external(pg, max_attempts=1)
    # (the in-database worker's recovery would conclude the leases first)
    with pg.engine_paused():
        lease_extended_while_concluded(pg, name)


def lease_extended_while_concluded(pg, name):
    x = pg.one(f"SELECT flow.enqueue('{name}', '{{}}', key => 'x')")   # keyed: a run row of its own
    time.sleep(0.01)
    y = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(x_cmd, tx, *_)] = claim(c, name, lease="1 second")
        [(y_cmd, ty, *_)] = claim(c, name, lease="2 seconds")
    assert (x_cmd, y_cmd) == (x, y)
    with pg.connect(autocommit=False) as x_holder, pg.connect(autocommit=False) as beating:
        x_holder.execute("SELECT 1")   # both transactions begin before the leases run out
        beating.execute("SELECT 1")
        time.sleep(2.5)
        # settled under a clock from before X's expiry; X stays locked meanwhile
        assert x_holder.execute("SELECT * FROM flow.complete_many(%s, %s)", ([x], [tx])).fetchall() == \
            [(x, "succeeded")]
        claimed = pg.waiting_call("SELECT command_id FROM flow.claim(%s, 'w2', 10)", ([name],), "%flow.claim%")
        expires, cancelled = beating.execute("SELECT * FROM flow.heartbeat(%s, %s, extend => '1 hour')",
                                             (y, ty)).fetchone()
        assert cancelled is False
        beating.commit()
        x_holder.commit()
    assert claimed() == []
    assert pg.all("SELECT status::text, lease_expires_at FROM flow.commands WHERE id = %s", y) == \
        [("running", expires)]
    assert pg.all("SELECT attempt, outcome FROM flow.attempts WHERE command_id = %s", y) == [(1, "running")]
    with pg.connect() as c:
        c.execute("SELECT flow.complete(%s, %s)", (y, ty))
    assert pg.await_run(y, "5s")[0] == "succeeded"


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


def test_a_wait_created_while_retention_deletes_its_event_waits_and_does_not_find_it(pg):
    """Event retention deletes an event only under its key's lock: a wait
    created on the key meanwhile (here by flow.complete's child) waits for
    the deletion to commit and then does not find the event (it referred to
    the event being deleted, and the completion failed on the foreign key,
    23503)."""
    parent, child = external(pg), external(pg)
    event = unique("paid")
    pg.one(f"SELECT flow.emit('{event}', 'order-7', '{{\"amount\": 10}}')")
    run = pg.one(f"SELECT flow.enqueue('{parent}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, parent)
    children = psycopg.types.json.Jsonb([{"name": child, "key": "ship", "within": "1 hour",
                                          "waits": [{"name": event, "key": "order-7"}]}])
    with pg.connect(autocommit=False) as retiring:
        assert retiring.execute("SELECT flow._retire_events('0 s', 100000)").fetchone()[0] >= 1
        completing = pg.waiting_call("SELECT flow.complete(%s, %s, '{}', NULL, %s)", (cmd, token, children),
                                     "%flow.complete%")
        retiring.commit()
    assert completing() == [("succeeded",)]
    assert pg.one("SELECT count(*) FROM flow._events WHERE name = %s", event) == 0
    assert pg.all("SELECT c.status::text, w.event_position FROM flow._waits w JOIN flow._commands c"
                  " ON c.id = w.command_id WHERE c.run_id = %s", run) == [("waiting", None)]


def test_resolve_tells_a_worker_what_became_of_its_attempt(pg):
    name = external(pg, max_attempts=3, backoff="'10 ms'", backoff_max="'10 ms'")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name, lease="1 s")
        assert c.execute("SELECT state FROM flow.resolve(%s, %s)", (cmd, token)).fetchone()[0] == "held"
        time.sleep(1.2)
        # expired, until the workers' recovery (every second) concludes it as lease_lost
        assert c.execute("SELECT state FROM flow.resolve(%s, %s)", (cmd, token)).fetchone()[0] in (
            "expired", "concluded")
        # a second claim completes
        pg.wait_for("SELECT status = 'pending' FROM flow._commands WHERE id = %s", cmd)
        assert c.execute("SELECT state, outcome FROM flow.resolve(%s, %s)", (cmd, token)).fetchone() == (
            "concluded", "lease_lost")
        time.sleep(0.2)    # the retry's 10 ms backoff
        [(cmd2, token2, *_)] = claim(c, name)
        c.execute("SELECT flow.complete(%s, %s)", (cmd2, token2))
        assert c.execute("SELECT state, outcome FROM flow.resolve(%s, %s)", (cmd2, token2)).fetchone() == (
            "concluded", "succeeded")
    assert pg.sqlstate("SELECT * FROM flow.resolve(%s, gen_random_uuid())", cmd) == "FL013"
    pg.all("DO $$ BEGIN CREATE ROLE res_other LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    assert pg.sqlstate("SELECT * FROM flow.resolve(%s, %s)", cmd, token, user="res_other") == "FL014"
    assert pg.await_run(run)[0] == "succeeded"


def test_a_stale_fail_from_an_external_worker_changes_nothing(pg):
    name = external(pg, max_attempts=3)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
    before = state(pg)
    assert pg.sqlstate("SELECT flow.fail(%s, %s, 'too late')", cmd, token) in ("FL013", "FL017")
    assert state(pg) == before
    assert pg.await_run(run)[0] == "succeeded"


def test_a_concurrency_limit_is_shared_by_workers_and_external_claimers(pg):
    q = unique("shared")
    pg.one(f"SELECT flow.set_queue('{q}', concurrency => 1)")
    ext = external(pg, queue=f"'{q}'")
    pg.one(f"SELECT flow.enqueue('{ext}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, ext)
        pg.all("CREATE OR REPLACE FUNCTION public.quick(args jsonb) RETURNS jsonb LANGUAGE sql AS 'SELECT args'")
        indb = unique("indb")
        pg.one(f"SELECT flow.define('{indb}', 'public.quick'::regproc, queue => '{q}')")
        run = pg.one(f"SELECT flow.enqueue('{indb}')")
        time.sleep(1.5)
        # the external claim holds the queue's only slot
        assert pg.one("SELECT status FROM flow._commands WHERE run_id = %s", run) == "pending"
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
    assert pg.await_run(run, "10s")[0] == "succeeded"


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
