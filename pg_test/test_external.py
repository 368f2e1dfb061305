"""External workers: programs outside the server claim commands of
definitions with no handler and settle them (complete, complete_many, fail),
under a lease they heartbeat, or held by their own transaction (flow.claim's
hold => true). (Their runs' cancel: test_cancel.py.)"""
import threading
import time
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from conftest import (EXTERNAL_APP, QUICK, app_cluster, await_interrupted, barrier, claim, command_attempts,
                      command_row, external, hold, hold_or_none, hold_when_due, poll, spread_over_two_queues,
                      unique)


@pytest.fixture(scope="module")
def pg():
    """One worker; roles alice and bob; `in_db_child`, an in-database
    definition whose handler records what it saw and returns its inputs."""
    cluster = app_cluster(EXTERNAL_APP, conf=("flow.workers = 1",))
    yield cluster
    cluster.stop()


def state(pg, name):
    """The finished attempts (a success is its command row: see
    sql/schema.sql) and running commands of definition `name`, and the
    events. (Of one definition: the module's other runs may change meanwhile,
    say an earlier test's lease that expires and is counted.)"""
    return pg.all("SELECT (SELECT count(*) FROM flow.attempts WHERE name = %s AND outcome <> 'running'),"
                  " (SELECT count(*) FROM flow._events),"
                  " (SELECT count(*) FROM flow._commands WHERE name = %s AND status = 'running')", name, name)[0]


# ---------------------------------------------------------------- leased claims

def test_in_database_workers_never_run_external_definitions(pg):
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    time.sleep(0.5)   # (time itself: no worker takes it within 0.5 s)
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s", run) == "pending"


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
    TRUNCATE (worker.rs, warm_plans), while commands may be due."""
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


# ---------------------------------------------------------------- leases: heartbeats, expiry, resolve

def test_a_heartbeat_extends_by_the_original_lease(pg):
    name = unique("ext")
    pg.one(f"SELECT flow.define('{name}', NULL)")
    pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        cmd, token = c.execute(f"SELECT command_id, lease_token FROM flow.claim(array['{name}'], 'w', 1, '2 s')"
                               ).fetchone()
        for _ in range(3):
            time.sleep(0.6)   # (time itself: each heartbeat extends from its own now)
            left = c.execute("SELECT extract(epoch FROM lease_expires_at - now()) FROM flow.heartbeat(%s, %s)",
                             (cmd, token)).fetchone()[0]
            assert 1.5 <= float(left) <= 2.1
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))


def test_a_lost_lease_is_retried_and_the_stale_complete_changes_nothing(pg):
    name = external(pg, max_attempts=3, backoff="'10 ms'")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, stale, *_)] = claim(c, name, worker="slow", lease="300 ms")
        pg.wait_for("SELECT coalesce(lease_expires_at, '-infinity') < now() FROM flow._commands WHERE id = %s", cmd)
        # the lease expired by the database clock: it is concluded as lease_lost
        # and retried after its backoff (10 ms)
        rows = poll(lambda: claim(c, name, worker="fast"), timeout=2.0, what="the retry's claim")
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
    time.sleep(0.01)   # (time itself: y is due after x, so claims take x first)
    y = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(x_cmd, tx, *_)] = claim(c, name, lease="1 second")
        [(y_cmd, ty, *_)] = claim(c, name, lease="2 seconds")
    assert (x_cmd, y_cmd) == (x, y)
    with pg.connect(autocommit=False) as x_holder, pg.connect(autocommit=False) as beating:
        x_holder.execute("SELECT 1")   # both transactions begin before the leases run out
        beating.execute("SELECT 1")
        pg.wait_for("SELECT count(*) = 2 FROM flow._commands WHERE id = ANY (%s) AND lease_expires_at < now()", [x, y])
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


def test_resolve_tells_a_worker_what_became_of_its_attempt(pg):
    name = external(pg, max_attempts=3, backoff="'10 ms'", backoff_max="'10 ms'")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name, lease="1 s")
        assert c.execute("SELECT state FROM flow.resolve(%s, %s)", (cmd, token)).fetchone()[0] == "held"
        pg.wait_for("SELECT coalesce(lease_expires_at, '-infinity') < now() FROM flow._commands WHERE id = %s", cmd)
        # expired, until the workers' recovery (every second) concludes it as lease_lost
        assert c.execute("SELECT state FROM flow.resolve(%s, %s)", (cmd, token)).fetchone()[0] in (
            "expired", "concluded")
        # a second claim completes
        pg.wait_for("SELECT status = 'pending' FROM flow._commands WHERE id = %s", cmd)
        assert c.execute("SELECT state, outcome FROM flow.resolve(%s, %s)", (cmd, token)).fetchone() == (
            "concluded", "lease_lost")
        pg.wait_for("SELECT next_run_at <= now() FROM flow._commands WHERE id = %s", cmd)   # the retry's 10 ms backoff
        [(cmd2, token2, *_)] = claim(c, name)
        c.execute("SELECT flow.complete(%s, %s)", (cmd2, token2))
        assert c.execute("SELECT state, outcome FROM flow.resolve(%s, %s)", (cmd2, token2)).fetchone() == (
            "concluded", "succeeded")
    assert pg.sqlstate("SELECT * FROM flow.resolve(%s, gen_random_uuid())", cmd) == "FL013"
    pg.all("DO $$ BEGIN CREATE ROLE res_other LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    assert pg.sqlstate("SELECT * FROM flow.resolve(%s, %s)", cmd, token, user="res_other") == "FL014"
    assert pg.await_run(run)[0] == "succeeded"


# ---------------------------------------------------------------- settlements

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
        pg.wait_for("SELECT next_run_at <= now() FROM flow._commands WHERE id = %s", cmd)   # (its retry_after)
        [(cmd, token, _, attempt, _)] = claim(c, name)
        assert attempt == 2
        assert c.execute("SELECT flow.fail(%s, %s, 'bad card', permanent => true)", (cmd, token)).fetchone()[0] == "failed"
    status, _, error = pg.await_run(run, "5s")
    assert status == "failed" and error["message"] == "bad card" and error["stop_reason"] == "permanent"


def test_bad_resolutions_change_nothing(pg):
    name = external(pg)
    pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        before = state(pg, name)
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
            assert state(pg, name) == before, query
        assert c.execute("SELECT flow.complete(%s, %s)", (cmd, token)).fetchone()[0] == "succeeded"
        after = state(pg, name)
        with pytest.raises(psycopg.Error) as caught:
            c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
        assert caught.value.sqlstate == "FL017"  # double completion
        assert state(pg, name) == after


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
        before = state(pg, name)
        out = dict(c.execute("SELECT * FROM flow.complete_many(%s, %s, %s::jsonb[])",
                             ([a, b, d], [ta, tb, uuid.UUID(int=0)],
                              ['{"r": 1}', '{"r": 2}', '{"r": 3}'])).fetchall())
        assert out == {a: "already_completed", b: "succeeded", d: "lease_lost"}
        assert pg.one("SELECT result FROM flow.commands WHERE id = %s", b) == {"r": 2}
        assert pg.one("SELECT status FROM flow.commands WHERE id = %s", d) == "running"
        assert state(pg, name)[0] == before[0] + 1  # one more finished attempt: b's
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
        pg.wait_for("SELECT coalesce(lease_expires_at, '-infinity') < now() FROM flow._commands WHERE id = %s", cmd)
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


def test_a_stale_fail_from_an_external_worker_changes_nothing(pg):
    name = external(pg, max_attempts=3)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect() as c:
        [(cmd, token, *_)] = claim(c, name)
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
    before = state(pg, name)
    assert pg.sqlstate("SELECT flow.fail(%s, %s, 'too late')", cmd, token) in ("FL013", "FL017")
    assert state(pg, name) == before
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
        time.sleep(1.5)   # (time itself: no worker runs it within 1.5 s)
        # the external claim holds the queue's only slot
        assert pg.one("SELECT status FROM flow._commands WHERE run_id = %s", run) == "pending"
        c.execute("SELECT flow.complete(%s, %s)", (cmd, token))
    assert pg.await_run(run, "10s")[0] == "succeeded"


# ---------------------------------------------------------------- held claims
# External claims held by the client's transaction (flow.claim's hold => true):
# the claim locks the commands' rows and writes nothing; their settlement in the
# same transaction writes each once; a transaction or subtransaction that ends
# with some unsettled leaves each attempt to worker 0, which concludes it as
# interrupted (transaction_ended), so a command whose client always dies still
# reaches its attempt limit.


def test_a_held_claim_writes_nothing_until_complete_many_writes_each_command_once(pg):
    """Held: attempt 1, no lease expiry, the rows stay pending to others and
    other sessions' claims (leased or held) skip them; complete_many in the
    same transaction writes succeeded, attempts 1, lease_owner the worker,
    and no _attempts row (the success is the command row)."""
    name = external(pg)
    runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[2]))")
    with pg.connect(autocommit=False) as c, pg.connect() as other, pg.connect(autocommit=False) as rival:
        rows = hold(c, name, worker="held-w", max_=5)
        assert len(rows) == 2
        assert all(attempt == 1 and expires is None and token is not None for _, token, attempt, expires in rows)
        ids, tokens = [r[0] for r in rows], [r[1] for r in rows]
        assert pg.all("SELECT c.status::text, c.attempts, x.lease_token FROM flow.commands c"
                      " JOIN flow._commands x USING (id) WHERE id = ANY (%s)", ids) == [("pending", 0, None)] * 2
        assert other.execute("SELECT * FROM flow.claim(%s, 'x', 10)", ([name],)).fetchall() == []
        assert hold(rival, name, worker="rival", max_=10) == []
        rival.rollback()
        assert sorted(c.execute("SELECT * FROM flow.complete_many(%s, %s)", (ids, tokens)).fetchall()) == \
            sorted((i, "succeeded") for i in ids)
        c.commit()
    for cmd in ids:
        assert command_row(pg, cmd) == ("succeeded", 1, "held-w", None)
        assert command_attempts(pg, cmd) == []
        assert pg.all("SELECT attempt, outcome, owner FROM flow.attempts WHERE command_id = %s", cmd) == \
            [(1, "succeeded", "held-w")]
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY (%s) AND status = 'succeeded'", runs) == 2


def test_a_poison_command_whose_transaction_always_rolls_back_reaches_its_attempt_limit(pg):
    """Each rollback leaves the attempt to worker 0: interrupted,
    transaction_ended, owner the claim's worker, attempts counted and the
    command retried after its backoff with the next attempt number; at
    max_attempts the command fails (attempt_limit) and so does the run."""
    name = external(pg, **QUICK)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect(autocommit=False) as c:
        for n in (1, 2, 3):
            [(cmd, _, attempt, _)] = hold(c, name, worker="poison") if n == 1 else hold_when_due(c, name, "poison")
            assert cmd == run and attempt == n
            c.rollback()
            await_interrupted(pg, cmd, n)
    pg.wait_for("SELECT status = 'failed' FROM flow.runs WHERE id = %s", run)
    assert command_attempts(pg, run) == [(n, "interrupted", "transaction_ended", "poison") for n in (1, 2, 3)]
    assert command_row(pg, run) == ("failed", 3, None, "attempt_limit")
    with pg.connect() as c:
        assert hold_or_none(c, name) == []


def test_a_commit_that_leaves_held_commands_unsettled_counts_them_and_keeps_what_it_settled(pg):
    """COMMIT with one of two held commands settled: that one succeeded, the
    other's attempt is concluded as interrupted and retried. PREPARE
    TRANSACTION while holding one unsettled: 0A000, and it is counted."""
    name = external(pg, **QUICK)
    pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[2]))")
    with pg.connect(autocommit=False) as c:
        (a, ta, _, _), (b, _, _, _) = hold(c, name, max_=2)
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([a], [ta])).fetchall() == [(a, "succeeded")]
        c.commit()
    await_interrupted(pg, b)
    assert command_row(pg, a) == ("succeeded", 1, "w", None) and command_attempts(pg, a) == []
    assert command_attempts(pg, b) == [(1, "interrupted", "transaction_ended", "w")]
    assert command_row(pg, b)[:2] == ("pending", 1)
    with pg.connect(autocommit=False) as c:
        [(again, _, attempt, _)] = hold_when_due(c, name)
        assert (again, attempt) == (b, 2)
        with pytest.raises(psycopg.Error) as caught:
            c.execute("PREPARE TRANSACTION 'held'")
        assert caught.value.sqlstate == "0A000"    # and the transaction ends unsettled
    await_interrupted(pg, b, 2)
    assert command_row(pg, b)[:2] == ("pending", 2)
    assert pg.one("SELECT count(*) FROM pg_prepared_xacts") == 0


def test_a_client_that_dies_holding_a_command_is_counted_until_the_attempt_limit(pg):
    """A client that disconnects, or whose backend is terminated, while
    holding: each attempt is concluded as interrupted; with max_attempts 2
    the run fails at the limit."""
    name = external(pg, max_attempts=2, backoff="'10 ms'", backoff_max="'10 ms'")
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    c = pg.connect(autocommit=False)
    assert [r[:3:2] for r in hold(c, name, worker="dies")] == [(run, 1)]
    c.close()                                      # the client disconnects mid-transaction
    await_interrupted(pg, run, 1)
    assert command_row(pg, run)[:2] == ("pending", 1)
    c = pg.connect(autocommit=False)
    assert [r[:3:2] for r in hold_when_due(c, name, worker="dies")] == [(run, 2)]
    assert pg.one("SELECT pg_terminate_backend(%s)", c.info.backend_pid) is True
    c.close()
    pg.wait_for("SELECT status = 'failed' FROM flow.runs WHERE id = %s", run)
    assert command_attempts(pg, run) == [(1, "interrupted", "transaction_ended", "dies"),
                                 (2, "interrupted", "transaction_ended", "dies")]
    assert command_row(pg, run) == ("failed", 2, None, "attempt_limit")


def test_a_claim_in_a_rolled_back_savepoint_is_counted_while_the_transaction_goes_on(pg):
    """ROLLBACK TO a savepoint that held a claim releases its row and counts
    the attempt at once, while the outer transaction stays open and settles
    what it claimed before the savepoint."""
    name = external(pg, **QUICK)
    pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[2]))")
    with pg.connect(autocommit=False) as c:
        [(a, ta, _, _)] = hold(c, name)
        c.execute("SAVEPOINT s")
        [(b, _, attempt, _)] = hold(c, name)
        assert b != a and attempt == 1
        c.execute("ROLLBACK TO SAVEPOINT s")
        await_interrupted(pg, b)                  # counted while c's transaction is still open
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert command_row(pg, b)[:2] == ("pending", 1)
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([a], [ta])).fetchall() == [(a, "succeeded")]
        c.commit()
    assert command_row(pg, a) == ("succeeded", 1, "w", None) and command_attempts(pg, a) == []
    assert command_attempts(pg, b) == [(1, "interrupted", "transaction_ended", "w")]


def test_a_settlement_rolled_back_to_a_savepoint_leaves_the_attempt_unsettled(pg):
    """complete_many inside a savepoint rolled back, then COMMIT: the command
    is not succeeded, its attempt is counted as interrupted. The same
    settlement in a released savepoint stands."""
    name = external(pg, **QUICK)
    pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[2]))")
    with pg.connect(autocommit=False) as c:
        (a, ta, _, _), (b, tb, _, _) = hold(c, name, max_=2)
        c.execute("SAVEPOINT undone")
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([a], [ta])).fetchall() == [(a, "succeeded")]
        c.execute("ROLLBACK TO SAVEPOINT undone")
        c.execute("SAVEPOINT kept")
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([b], [tb])).fetchall() == [(b, "succeeded")]
        c.execute("RELEASE SAVEPOINT kept")
        c.commit()
    await_interrupted(pg, a)
    assert command_attempts(pg, a) == [(1, "interrupted", "transaction_ended", "w")]
    assert command_row(pg, a)[:2] == ("pending", 1)
    assert command_row(pg, b) == ("succeeded", 1, "w", None) and command_attempts(pg, b) == []


def test_a_held_claim_outside_a_transaction_block_or_for_a_second_worker_fails_and_changes_nothing(pg):
    """hold => true in autocommit: 25P01; a second held claim in the same
    transaction under another worker name: 22023. Neither takes or counts
    anything; the first claim of the transaction still settles."""
    name = external(pg, **QUICK)
    pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[2]))")
    assert pg.sqlstate("SELECT * FROM flow.claim(%s, 'w', 1, hold => true)", [name]) == "25P01"
    with pg.connect(autocommit=False) as c:
        [(a, ta, _, _)] = hold(c, name, worker="first")
        c.execute("SAVEPOINT s")
        with pytest.raises(psycopg.Error) as caught:
            hold(c, name, worker="second")
        assert caught.value.sqlstate == "22023"
        c.execute("ROLLBACK TO SAVEPOINT s")
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([a], [ta])).fetchall() == [(a, "succeeded")]
        c.commit()
    barrier(pg)
    assert pg.all("SELECT status::text, attempts FROM flow._commands WHERE name = %s ORDER BY attempts", name) == \
        [("pending", 0), ("succeeded", 1)]
    assert pg.one("SELECT count(*) FROM flow._attempts a JOIN flow._commands c ON c.id = a.command_id"
                  " WHERE c.name = %s", name) == 0


def test_fail_on_a_held_command_writes_one_attempt_and_applies_the_retry_policy(pg):
    """flow.fail of a held command: one _attempts row (retryable, then
    permanent), the attempt numbers 1 and 2, nothing counted twice when
    the transaction commits; permanent fails the run."""
    name = external(pg, **QUICK)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect(autocommit=False) as c:
        [(cmd, token, attempt, _)] = hold(c, name)
        assert attempt == 1
        assert c.execute("SELECT flow.fail(%s, %s, 'boom')", (cmd, token)).fetchone()[0] == "retry"
        c.commit()
        assert command_row(pg, cmd)[:2] == ("pending", 1)
        [(cmd2, token, attempt, _)] = hold_when_due(c, name)
        assert (cmd2, attempt) == (cmd, 2)
        assert c.execute("SELECT flow.fail(%s, %s, 'bad card', permanent => true)",
                         (cmd, token)).fetchone()[0] == "failed"
        c.commit()
    barrier(pg)
    assert command_attempts(pg, cmd) == [(1, "retryable", "worker_error", "w"), (2, "permanent", "permanent", "w")]
    assert command_row(pg, cmd) == ("failed", 2, None, "permanent")
    status, _, error = pg.await_run(run, "5s")
    assert status == "failed" and error["message"] == "bad card"


def test_complete_with_events_and_children_on_a_held_root_drives_the_run(pg):
    """flow.complete of a held root with an event and children: the root is
    written once (succeeded, no _attempts row), the children are created and
    the run runs until they finish (an external child, settled held too, and
    an in-database child waiting for the event)."""
    root, child = external(pg), external(pg)
    key = unique("order")
    run = pg.one(f"SELECT flow.enqueue('{root}')")
    children = Jsonb([{"name": child, "key": "ext", "args": {"n": 1}},
                      {"name": "in_db_child", "key": "after", "waits": [{"name": "paid", "key": key}],
                       "within": "1 minute"}])
    events = Jsonb([{"name": "paid", "key": key, "payload": {"amount": 5}}])
    with pg.connect(autocommit=False) as c:
        [(cmd, token, _, _)] = hold(c, root)
        assert c.execute("SELECT flow.complete(%s, %s, '{\"root\": 1}', %s, %s)",
                         (cmd, token, events, children)).fetchone()[0] == "succeeded"
        c.commit()
    assert command_row(pg, cmd) == ("succeeded", 1, "w", None) and command_attempts(pg, cmd) == []
    assert pg.one("SELECT count(*) FROM flow._commands WHERE parent_id = %s", cmd) == 2
    pg.wait_for("SELECT EXISTS (SELECT 1 FROM app.effects WHERE run_id = %s AND key = 'after')", run)
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "running"
    with pg.connect(autocommit=False) as c:
        [(ext, token, _, _)] = hold(c, child)
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([ext], [token])).fetchall() == \
            [(ext, "succeeded")]
        c.commit()
    assert pg.await_run(run, "10s") == ("succeeded", {"root": 1}, None)
    after = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'after'", run)
    assert after["inputs"][0]["payload"] == {"amount": 5}


def test_a_held_token_means_held_in_its_transaction_and_nothing_elsewhere(pg):
    """In the holding transaction heartbeat gives (NULL, false) and resolve
    'held'. Another session's complete_many reports lease_lost and changes
    nothing; its flow.complete and flow.fail raise FL013 (once the holder
    is gone: the rollback is then counted as interrupted, nothing else, and
    resolve finds that attempt under the held token)."""
    name = external(pg, **QUICK)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect(autocommit=False) as c:
        [(cmd, token, _, _)] = hold(c, name)
        assert c.execute("SELECT * FROM flow.heartbeat(%s, %s)", (cmd, token)).fetchall() == [(None, False)]
        assert c.execute("SELECT * FROM flow.resolve(%s, %s)", (cmd, token)).fetchall() == [("held", None, None)]
        assert pg.all("SELECT * FROM flow.complete_many(%s, %s)", [cmd], [token]) == [(cmd, "lease_lost")]
        assert command_row(pg, cmd) == ("pending", 0, None, None)
        # (they wait for the held row's lock)
        completing = pg.waiting_call("SELECT flow.complete(%s, %s)", (cmd, token), "%flow.complete(%")
        failing = pg.waiting_call("SELECT flow.fail(%s, %s, 'x')", (cmd, token), "%flow.fail(%")
        c.rollback()
    assert (completing(), failing()) == ("FL013", "FL013")
    await_interrupted(pg, cmd)
    assert command_row(pg, cmd)[:2] == ("pending", 1)
    assert command_attempts(pg, cmd) == [(1, "interrupted", "transaction_ended", "w")]
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "running"
    # the attempt is counted under the token its client was given: a client
    # that lost its connection learns what became of it
    assert pg.all("SELECT * FROM flow.resolve(%s, %s)", cmd, token) == [("concluded", "interrupted", None)]


def test_another_role_cannot_claim_or_settle_held_commands(pg):
    """bob, not a member of alice: FL001 from claim, FL014 from complete_many,
    complete and fail on alice's held command; alice's settlement stands."""
    name = external(pg, user="alice")
    run = pg.one(f"SELECT flow.enqueue('{name}')", user="alice")
    with pg.connect("alice", autocommit=False) as c:
        [(cmd, token, _, _)] = hold(c, name, worker="alice-w")
        with pg.connect("bob", autocommit=False) as b:
            with pytest.raises(psycopg.Error) as caught:
                hold(b, name, worker="bob-w")
            assert caught.value.sqlstate == "FL001"
        assert pg.sqlstate("SELECT * FROM flow.complete_many(%s, %s)", [cmd], [token], user="bob") == "FL014"
        assert pg.sqlstate("SELECT flow.complete(%s, %s)", cmd, token, user="bob") == "FL014"
        assert pg.sqlstate("SELECT flow.fail(%s, %s, 'x')", cmd, token, user="bob") == "FL014"
        assert command_row(pg, cmd) == ("pending", 0, None, None)
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([cmd], [token])).fetchall() == \
            [(cmd, "succeeded")]
        c.commit()
    assert command_row(pg, cmd) == ("succeeded", 1, "alice-w", None) and command_attempts(pg, cmd) == []
    assert pg.await_run(run, "5s", user="alice")[0] == "succeeded"


def test_a_held_claim_in_a_limited_queue_takes_a_lease_the_limit_counts(pg):
    """In a queue with a concurrency limit a held claim falls back to a lease
    (lease_expires_at set, running to others, the limit counts it: no one
    else claims); complete_many in the same transaction settles it."""
    q = unique("heldq")
    pg.one(f"SELECT flow.set_queue('{q}', concurrency => 1)")
    name = external(pg, queue=f"'{q}'")
    pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[3]))")
    with pg.connect(autocommit=False) as c:
        [(a, ta, attempt, expires)] = hold(c, name, max_=3)
        assert attempt == 1 and expires is not None
        assert hold(c, name) == []
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([a], [ta])).fetchall() == [(a, "succeeded")]
        c.commit()
        [(b, tb, _, expires)] = hold(c, name)
        assert expires is not None
        c.commit()     # unsettled: its lease stands, and counts
        assert pg.one("SELECT status FROM flow.commands WHERE id = %s", b) == "running"
        with pg.connect() as other:
            assert other.execute("SELECT * FROM flow.claim(%s, 'x', 5)", ([name],)).fetchall() == []
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([b], [tb])).fetchall() == [(b, "succeeded")]
        c.commit()
    assert command_row(pg, a) == ("succeeded", 1, "w", None) and command_row(pg, b) == ("succeeded", 1, "w", None)
    with pg.connect() as other:
        assert len(other.execute("SELECT * FROM flow.claim(%s, 'x', 5)", ([name],)).fetchall()) == 1


def test_claims_in_one_transaction_never_return_the_same_command_twice(pg):
    """The transaction's own row locks do not make SKIP LOCKED skip them: the
    claim leaves out what this transaction holds unsettled. Three claims
    take three distinct commands, a fourth none; all settle."""
    name = external(pg)
    pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[4]))")
    with pg.connect(autocommit=False) as c:
        rows = hold(c, name) + hold(c, name) + hold(c, name, max_=2)
        assert len(rows) == 4 and len({r[0] for r in rows}) == 4
        assert hold(c, name, max_=10) == []
        out = c.execute("SELECT status FROM flow.complete_many(%s, %s)",
                        ([r[0] for r in rows], [r[1] for r in rows])).fetchall()
        assert out == [("succeeded",)] * 4
        c.commit()
    assert pg.all("SELECT status::text, attempts FROM flow._commands WHERE name = %s", name) == \
        [("succeeded", 1)] * 4


def test_claims_leave_an_abandoned_attempt_alone_until_worker_0_counts_it(pg):
    """Until worker 0 has concluded an abandoned attempt (here: held off with
    flow.enabled = off), claims, leased or held, leave its command alone
    (no attempt number is taken twice); once counted, the retry is attempt 2."""
    name = external(pg, **QUICK)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.engine_paused():
        with pg.connect(autocommit=False) as c:
            assert [r[0] for r in hold(c, name)] == [run]
            c.rollback()
            time.sleep(0.3)                         # (time itself: past the 10 ms backoff a retry would have)
            assert hold(c, name) == []
            c.rollback()
            assert c.execute("SELECT * FROM flow.claim(%s, 'x', 5)", ([name],)).fetchall() == []
            c.rollback()
        assert command_row(pg, run)[:2] == ("pending", 0) and command_attempts(pg, run) == []
    await_interrupted(pg, run)
    with pg.connect(autocommit=False) as c:
        [(cmd, token, attempt, _)] = hold_when_due(c, name)
        assert (cmd, attempt) == (run, 2)
        c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([cmd], [token]))
        c.commit()
    assert command_row(pg, run) == ("succeeded", 2, "w", None)
    assert command_attempts(pg, run) == [(1, "interrupted", "transaction_ended", "w")]


def test_worker_0_never_waits_for_an_abandoned_command_locked_elsewhere(pg):
    """A transaction that keeps an abandoned command's row locked (here a
    superuser's; a client's open transaction may hold its run) does not hold
    up worker 0: the other abandoned attempts are counted meanwhile, and that
    one once the lock is gone."""
    name = external(pg, **QUICK)
    locked_run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect(autocommit=False) as locker:
        with pg.engine_paused():                   # (worker 0 counts nothing until the row is locked)
            with pg.connect(autocommit=False) as c:
                assert [r[0] for r in hold(c, name)] == [locked_run]
                c.rollback()
            locker.execute("SELECT 1 FROM flow._commands WHERE id = %s FOR UPDATE", (locked_run,))
        other = external(pg, **QUICK)
        other_run = pg.one(f"SELECT flow.enqueue('{other}')")
        with pg.connect(autocommit=False) as c:
            assert [r[0] for r in hold(c, other)] == [other_run]
            c.rollback()
        await_interrupted(pg, other_run)
        time.sleep(0.3)   # (time itself: worker 0 has counted the other one, and leaves this one alone)
        assert command_attempts(pg, locked_run) == [] and command_row(pg, locked_run)[:2] == ("pending", 0)
        locker.rollback()
    await_interrupted(pg, locked_run)
    assert command_attempts(pg, locked_run) == [(1, "interrupted", "transaction_ended", "w")]


def test_held_commands_have_room_to_be_counted_reserved_at_their_claim(pg):
    """Every held command has a place among the abandoned attempts from its
    claim on (16,384 in all), so one role holding many cannot make another's
    abandoned attempt go uncounted: past the room, a held claim fails (53400)
    and the attempts it noted before are counted; the places come back when
    the transactions end. (A superuser's claims, these, have no per-role
    limit: test_security.py checks that one.)"""
    name = external(pg, **QUICK)
    with pg.connect() as c:
        for _ in range(17):
            c.execute(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[1000]))")
    with pg.connect(autocommit=False) as c:
        assert len(hold(c, name, max_=10000)) + len(hold(c, name, max_=6288)) == 16288
        c.execute("SAVEPOINT more")
        with pytest.raises(psycopg.errors.ConfigurationLimitExceeded):
            hold(c, name, max_=200)
        c.execute("ROLLBACK TO SAVEPOINT more")
        # the 96 it had noted are counted (their places went to them), and then free again
        pg.wait_for("SELECT count(*) = 96 FROM flow._attempts a JOIN flow._commands c ON c.id = a.command_id"
                    " WHERE c.name = %s AND a.outcome = 'interrupted'", name, timeout=30.0)
        c.execute("SAVEPOINT again")
        assert len(hold(c, name, max_=96)) == 96     # (of the 616 never claimed)
        with pytest.raises(psycopg.errors.ConfigurationLimitExceeded):
            hold(c, name, max_=1)
        c.execute("ROLLBACK TO SAVEPOINT again")
        c.commit()                            # (the 16,288 unsettled: counted too)
    pg.wait_for("SELECT count(*) = 16480 FROM flow._attempts a JOIN flow._commands c ON c.id = a.command_id"
                " WHERE c.name = %s AND a.outcome = 'interrupted'", name, timeout=120.0)
    barrier(pg)                               # (a held claim works again: the places came back)


def test_a_held_command_its_own_transaction_moved_is_settled_where_it_is_now(pg):
    """A held waiting command (claimed when its wait timed out) that an emit
    in the same transaction makes pending is no longer at the row its claim
    noted: complete_many still settles it (once, succeeded, attempt 1, no
    interrupted attempt at commit); the rest of the call is settled as held."""
    root, child = external(pg), external(pg)
    key = unique("moved")
    run = pg.one(f"SELECT flow.enqueue('{root}')")
    with pg.connect(autocommit=False) as c:
        [(cmd, token, _, _)] = hold(c, root)
        children = Jsonb([{"name": child, "key": "wait", "waits": [{"name": "moved", "key": key}],
                           "within": "100 milliseconds"}])
        assert c.execute("SELECT flow.complete(%s, %s, NULL, NULL, %s)", (cmd, token, children)).fetchone()[0] == \
            "succeeded"
        c.commit()
    waiting = pg.one("SELECT id FROM flow._commands WHERE parent_id = %s", cmd)
    assert command_row(pg, waiting)[0] == "waiting"
    other = pg.one(f"SELECT flow.enqueue('{child}')")
    # (a held claim rolled back would count an attempt: claim once, when both are due)
    pg.wait_for("SELECT next_run_at < now() - interval '50 ms' FROM flow._commands WHERE id = %s", waiting)
    with pg.connect(autocommit=False) as c:
        rows = hold(c, child, max_=2)
        assert {r[0] for r in rows} == {waiting, other}
        c.execute("SELECT flow.emit('moved', %s)", (key,))
        assert pg.one("SELECT status::text FROM flow._commands WHERE id = %s", waiting) == "waiting"  # (not yet committed)
        out = c.execute("SELECT * FROM flow.complete_many(%s, %s)",
                        ([r[0] for r in rows], [r[1] for r in rows])).fetchall()
        assert sorted(out) == sorted([(waiting, "succeeded"), (other, "succeeded")])
        c.commit()
    barrier(pg)
    for command in (waiting, other):
        assert command_row(pg, command) == ("succeeded", 1, "w", None) and command_attempts(pg, command) == []
    assert pg.await_run(run, "10s")[0] == "succeeded"


def test_an_abandoned_attempt_whose_conclusion_fails_is_tried_again_until_counted(pg):
    """Worker 0's conclusion of an abandoned attempt fails (here a trigger
    refuses its _attempts row): the attempt stays in the list, its command
    left alone by claims, tried again each second with one LOG line, and is
    counted once the conclusion can be made."""
    name = external(pg, **QUICK)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    pg.all("""
        CREATE TABLE IF NOT EXISTS app.refused_attempts (command_id uuid);
        CREATE OR REPLACE FUNCTION app.refuse_attempt() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM app.refused_attempts r WHERE r.command_id = NEW.command_id) THEN
                RAISE EXCEPTION 'refused by the test';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_attempt BEFORE INSERT ON flow._attempts
            FOR EACH ROW EXECUTE FUNCTION app.refuse_attempt();""")
    try:
        pg.all("INSERT INTO app.refused_attempts VALUES (%s)", run)
        with pg.connect(autocommit=False) as c:
            assert [r[0] for r in hold(c, name)] == [run]
            c.rollback()
        time.sleep(2.5)                               # (time itself: two tries or three)
        assert command_row(pg, run)[:2] == ("pending", 0) and command_attempts(pg, run) == []
        with pg.connect(autocommit=False) as c:
            assert hold(c, name) == []                # (still waiting for worker 0)
            c.rollback()
        assert pg.log().count(f"of command {run} could not be concluded; trying again") == 1
        pg.all("DELETE FROM app.refused_attempts")
        await_interrupted(pg, run)
    finally:
        pg.all("DROP TRIGGER refuse_attempt ON flow._attempts")
    assert command_attempts(pg, run) == [(1, "interrupted", "transaction_ended", "w")]
    assert command_row(pg, run)[:2] == ("pending", 1)


def test_a_savepoint_rolled_back_with_all_the_held_claims_takes_their_worker_name_too(pg):
    """The worker name of a transaction's held claims goes with the last of
    them: after ROLLBACK TO a savepoint that undid every held claim, a claim
    under another name holds (no 22023); the first claim's attempt is counted."""
    name = external(pg, **QUICK)
    runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[2]))")
    with pg.connect(autocommit=False) as c:
        c.execute("SAVEPOINT s")
        [(first, _, _, _)] = hold(c, name, worker="first")
        c.execute("ROLLBACK TO SAVEPOINT s")
        [(cmd, token, _, _)] = hold(c, name, worker="second")
        [second] = [run for run in runs if run != first]
        assert cmd == second
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([cmd], [token])).fetchall() == \
            [(cmd, "succeeded")]
        c.commit()
    assert command_row(pg, second) == ("succeeded", 1, "second", None)
    await_interrupted(pg, first)
    assert command_attempts(pg, first) == [(1, "interrupted", "transaction_ended", "first")]


def test_a_held_claim_from_several_queues_gets_its_max_of_distinct_commands(pg):
    """A held claim from several queues and definitions takes each one's share,
    then the rest from those that have more: the commands it already holds
    are locked by its own transaction, which SKIP LOCKED does not skip, and
    are left alone, so it gets its max of distinct commands, each held once,
    and settles them all."""
    first, second, queues = spread_over_two_queues(pg, external)
    with pg.connect(autocommit=False) as c:
        rows = c.execute("SELECT command_id, lease_token, name, queue, lease_expires_at"
                         " FROM flow.claim(%s, 'w', 8, hold => true)", ([first, second],)).fetchall()
        taken = {}
        for _, _, n, q, _ in rows:
            taken[(n, q)] = taken.get((n, q), 0) + 1
        assert taken == {(first, queues[0]): 5, (first, queues[1]): 1, (second, queues[0]): 2}, taken
        assert len({r[0] for r in rows}) == 8 and all(r[4] is None for r in rows)
        statuses = c.execute("SELECT status FROM flow.complete_many(%s, %s)",
                             ([r[0] for r in rows], [r[1] for r in rows])).fetchall()
        assert statuses == [("succeeded",)] * 8, statuses
        c.commit()
    assert pg.one("SELECT count(*) FROM flow._commands WHERE name = ANY (%s) AND status = 'succeeded'"
                  " AND attempts = 1", [first, second]) == 8
