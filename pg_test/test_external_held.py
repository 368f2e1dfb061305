"""External claims held by the client's transaction (flow.claim's hold => true):
the claim locks the commands' rows and writes nothing; their settlement in the
same transaction writes each once; a transaction or subtransaction that ends
with some unsettled leaves each attempt to worker 0, which concludes it as
interrupted (transaction_ended), so a command whose client always dies still
reaches its attempt limit."""
import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from conftest import define_external, external_workers_cluster, spread_over_two_queues, unique


@pytest.fixture(scope="module")
def pg():
    cluster = external_workers_cluster()
    yield cluster
    cluster.stop()


def external(pg, user="postgres", **kw):
    return define_external(pg, "held", user, **kw)


QUICK = {"max_attempts": 3, "backoff": "'10 ms'", "backoff_max": "'10 ms'"}


def hold(conn, name, worker="w", max_=1):
    """A held claim: (command_id, lease_token, attempt, lease_expires_at) rows."""
    return conn.execute("SELECT command_id, lease_token, attempt, lease_expires_at"
                        " FROM flow.claim(%s, %s, %s, hold => true)", ([name], worker, max_)).fetchall()


def hold_when_due(conn, name, worker="w", timeout=10.0):
    """Claim held once the command is due again (after worker 0's conclusion and the backoff),
    each try in a transaction of its own (conn holds nothing else)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = hold(conn, name, worker)
        if rows:
            return rows
        conn.rollback()    # (due by now(): the transaction's start)
        time.sleep(0.05)
    raise AssertionError(f"{name}: nothing came due")


def row(pg, cmd):
    return pg.all("SELECT status::text, attempts, lease_owner, stop_reason FROM flow._commands WHERE id = %s",
                  cmd)[0]


def attempts(pg, cmd):
    return pg.all("SELECT attempt, outcome, error_code, owner FROM flow._attempts WHERE command_id = %s"
                  " ORDER BY attempt", cmd)


def await_interrupted(pg, cmd, count=1):
    """Worker 0 concludes an abandoned attempt within about a second."""
    pg.wait_for("SELECT count(*) >= %s FROM flow._attempts WHERE command_id = %s AND outcome = 'interrupted'",
                count, cmd, timeout=5.0)


def barrier(pg):
    """Abandon a held attempt of a command of its own and wait for worker 0 to
    conclude it: whatever was abandoned before has been concluded by then."""
    name = external(pg)
    run = pg.one(f"SELECT flow.enqueue('{name}')")
    with pg.connect(autocommit=False) as c:
        assert len(hold(c, name, worker="barrier")) == 1
        c.rollback()
    await_interrupted(pg, run)


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
        assert row(pg, cmd) == ("succeeded", 1, "held-w", None)
        assert attempts(pg, cmd) == []
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
    assert attempts(pg, run) == [(n, "interrupted", "transaction_ended", "poison") for n in (1, 2, 3)]
    assert row(pg, run) == ("failed", 3, None, "attempt_limit")
    with pg.connect() as c:
        assert hold_or_none(c, name) == []


def hold_or_none(conn, name):
    with conn.transaction(force_rollback=True):
        return hold(conn, name)


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
    assert row(pg, a) == ("succeeded", 1, "w", None) and attempts(pg, a) == []
    assert attempts(pg, b) == [(1, "interrupted", "transaction_ended", "w")]
    assert row(pg, b)[:2] == ("pending", 1)
    with pg.connect(autocommit=False) as c:
        [(again, _, attempt, _)] = hold_when_due(c, name)
        assert (again, attempt) == (b, 2)
        with pytest.raises(psycopg.Error) as caught:
            c.execute("PREPARE TRANSACTION 'held'")
        assert caught.value.sqlstate == "0A000"    # and the transaction ends unsettled
    await_interrupted(pg, b, 2)
    assert row(pg, b)[:2] == ("pending", 2)
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
    assert row(pg, run)[:2] == ("pending", 1)
    c = pg.connect(autocommit=False)
    assert [r[:3:2] for r in hold_when_due(c, name, worker="dies")] == [(run, 2)]
    assert pg.one("SELECT pg_terminate_backend(%s)", c.info.backend_pid) is True
    c.close()
    pg.wait_for("SELECT status = 'failed' FROM flow.runs WHERE id = %s", run)
    assert attempts(pg, run) == [(1, "interrupted", "transaction_ended", "dies"),
                                 (2, "interrupted", "transaction_ended", "dies")]
    assert row(pg, run) == ("failed", 2, None, "attempt_limit")


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
        assert row(pg, b)[:2] == ("pending", 1)
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([a], [ta])).fetchall() == [(a, "succeeded")]
        c.commit()
    assert row(pg, a) == ("succeeded", 1, "w", None) and attempts(pg, a) == []
    assert attempts(pg, b) == [(1, "interrupted", "transaction_ended", "w")]


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
    assert attempts(pg, a) == [(1, "interrupted", "transaction_ended", "w")]
    assert row(pg, a)[:2] == ("pending", 1)
    assert row(pg, b) == ("succeeded", 1, "w", None) and attempts(pg, b) == []


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
        assert row(pg, cmd)[:2] == ("pending", 1)
        [(cmd2, token, attempt, _)] = hold_when_due(c, name)
        assert (cmd2, attempt) == (cmd, 2)
        assert c.execute("SELECT flow.fail(%s, %s, 'bad card', permanent => true)",
                         (cmd, token)).fetchone()[0] == "failed"
        c.commit()
    barrier(pg)
    assert attempts(pg, cmd) == [(1, "retryable", "worker_error", "w"), (2, "permanent", "permanent", "w")]
    assert row(pg, cmd) == ("failed", 2, None, "permanent")
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
    assert row(pg, cmd) == ("succeeded", 1, "w", None) and attempts(pg, cmd) == []
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
        assert row(pg, cmd) == ("pending", 0, None, None)
        # (they wait for the held row's lock)
        completing = pg.waiting_call("SELECT flow.complete(%s, %s)", (cmd, token), "%flow.complete(%")
        failing = pg.waiting_call("SELECT flow.fail(%s, %s, 'x')", (cmd, token), "%flow.fail(%")
        c.rollback()
    assert (completing(), failing()) == ("FL013", "FL013")
    await_interrupted(pg, cmd)
    assert row(pg, cmd)[:2] == ("pending", 1)
    assert attempts(pg, cmd) == [(1, "interrupted", "transaction_ended", "w")]
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
        assert row(pg, cmd) == ("pending", 0, None, None)
        assert c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([cmd], [token])).fetchall() == \
            [(cmd, "succeeded")]
        c.commit()
    assert row(pg, cmd) == ("succeeded", 1, "alice-w", None) and attempts(pg, cmd) == []
    assert pg.await_run(run, "5s", user="alice")[0] == "succeeded"


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
        assert row(pg, cmd) == ("succeeded", 1, "w", None)
    else:
        assert cancel() == [(True,)]
        barrier(pg)
        assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "cancelled"
        # counted if worker 0 concluded it before the cancel took the row; never revived
        status, count, _, reason = row(pg, cmd)
        assert (status, reason) == ("cancelled", "cancelled")
        assert attempts(pg, cmd) == [(1, "interrupted", "transaction_ended", "w")][:count]
        with pg.connect() as c:
            assert hold_or_none(c, name) == []


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
    assert row(pg, a) == ("succeeded", 1, "w", None) and row(pg, b) == ("succeeded", 1, "w", None)
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
            time.sleep(0.3)                         # (past the 10 ms backoff a retry would have)
            assert hold(c, name) == []
            c.rollback()
            assert c.execute("SELECT * FROM flow.claim(%s, 'x', 5)", ([name],)).fetchall() == []
            c.rollback()
        assert row(pg, run)[:2] == ("pending", 0) and attempts(pg, run) == []
    await_interrupted(pg, run)
    with pg.connect(autocommit=False) as c:
        [(cmd, token, attempt, _)] = hold_when_due(c, name)
        assert (cmd, attempt) == (run, 2)
        c.execute("SELECT * FROM flow.complete_many(%s, %s)", ([cmd], [token]))
        c.commit()
    assert row(pg, run) == ("succeeded", 2, "w", None)
    assert attempts(pg, run) == [(1, "interrupted", "transaction_ended", "w")]


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
        time.sleep(0.3)
        assert attempts(pg, locked_run) == [] and row(pg, locked_run)[:2] == ("pending", 0)
        locker.rollback()
    await_interrupted(pg, locked_run)
    assert attempts(pg, locked_run) == [(1, "interrupted", "transaction_ended", "w")]


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
    assert row(pg, waiting)[0] == "waiting"
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
        assert row(pg, command) == ("succeeded", 1, "w", None) and attempts(pg, command) == []
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
        time.sleep(2.5)                               # (two tries or three)
        assert row(pg, run)[:2] == ("pending", 0) and attempts(pg, run) == []
        with pg.connect(autocommit=False) as c:
            assert hold(c, name) == []                # (still waiting for worker 0)
            c.rollback()
        assert pg.log().count(f"of command {run} could not be concluded; trying again") == 1
        pg.all("DELETE FROM app.refused_attempts")
        await_interrupted(pg, run)
    finally:
        pg.all("DROP TRIGGER refuse_attempt ON flow._attempts")
    assert attempts(pg, run) == [(1, "interrupted", "transaction_ended", "w")]
    assert row(pg, run)[:2] == ("pending", 1)


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
    assert row(pg, second) == ("succeeded", 1, "second", None)
    await_interrupted(pg, first)
    assert attempts(pg, first) == [(1, "interrupted", "transaction_ended", "first")]


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
