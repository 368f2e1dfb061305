"""Retention: finished runs are pruned (with their commands, attempts and
waits) in windows of runs that move past a backlog of unfinished ones, and
counted when the pruning commits; old events no wait refers to are retired,
under their key's lock. (The workers' pruning of a whole module's history:
test_engine.py, test_finished_runs_are_pruned_after_the_retention; a cancel
meeting the pruning: test_cancel.py; event retention by index: test_scale.py.)"""
import time

import psycopg
import psycopg.types.json
import pytest

from conftest import ENGINE_APP, app_cluster, claim, define, enqueue, external, unique


@pytest.fixture(scope="module")
def pg():
    cluster = app_cluster(ENGINE_APP)
    yield cluster
    cluster.stop()


# ---------------------------------------------------------------- pruning runs

def test_pruned_runs_are_counted_when_the_pruning_commits(app):
    """flow.stats counts the runs pruning deleted (pruned_runs, also in
    flow.prometheus), when its transaction commits: a pass rolled back counts
    none."""
    name = define(app, "app.hello")
    runs = [enqueue(app, name) for _ in range(3)]
    for run in runs:
        assert app.await_run(run, "10s")[0] == "succeeded"
    counted = "SELECT value FROM flow.stats WHERE name = 'pruned_runs'"
    before = app.one(counted)
    with app.connect() as c:
        with c.transaction(force_rollback=True):
            assert c.execute("SELECT pruned FROM flow._prune('0 s', 1000, NULL)").fetchone()[0] >= 3
    assert app.one(counted) == before
    pruned = app.one("SELECT pruned FROM flow._prune('0 s', 1000, NULL)")
    assert pruned >= 3
    assert app.one("SELECT count(*) FROM flow._run_rows WHERE id = ANY (%s)", runs) == 0
    assert app.one(counted) == before + pruned
    assert app.one("SELECT line FROM flow.prometheus WHERE line LIKE 'flow\\_pruned\\_runs\\_total %%'") == \
        f"flow_pruned_runs_total {before + pruned}"


def test_pruning_keeps_pace_with_a_backlog_of_finished_runs(app):
    """While more is past its retention, the maintenance worker prunes pass
    after pass, not one 25 ms pass a second: its rounds gated it, 5,000-10,000
    runs/s, and a churn of 55,000 runs/s grew the tables without end
    (benches/RESULTS.md, FB). 100,000 finished runs go within 5 s (10 s and
    more before)."""
    name = define(app, "flow.noop(jsonb)")
    for _ in range(100):
        app.one(f"SELECT cardinality(flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[1000])))")
    app.wait_for("SELECT count(*) = 0 FROM flow._commands WHERE name = %s AND finished_at IS NULL", name, timeout=60)
    time.sleep(1.0)   # (time itself: every one of them past a retention of 1 s)
    app.all("ALTER SYSTEM SET flow.retention = '1s'")
    app.all("SELECT pg_reload_conf()")
    started = time.time()
    try:
        app.wait_for("SELECT count(*) = 0 FROM flow._commands WHERE name = %s", name, timeout=30)
    finally:
        app.all("ALTER SYSTEM RESET flow.retention")
        app.all("SELECT pg_reload_conf()")
    assert time.time() - started < 5.0


def test_pruning_commits_without_waiting_for_its_flush(app):
    """A pass of pruning (or of retiring events) commits without waiting for
    its WAL to reach disk: a deletion a crash loses is done again; and it
    compresses the full-page images it writes (lz4: the server's is off).
    Only its own transaction does: the session's settings are back at the next."""
    with app.connect() as c:
        session = c.execute("SHOW synchronous_commit").fetchone()[0]
        assert session != "off"
        assert c.execute("SHOW wal_compression").fetchone()[0] == "off"
        for pass_ in ("SELECT * FROM flow._prune('1 hour', 10, NULL)", "SELECT flow._retire_events('1 hour', 10)"):
            with c.transaction():
                c.execute(pass_)
                assert c.execute("SHOW synchronous_commit").fetchone()[0] == "off"
                assert c.execute("SHOW wal_compression").fetchone()[0] == "lz4"
            assert c.execute("SHOW synchronous_commit").fetchone()[0] == session
            assert c.execute("SHOW wal_compression").fetchone()[0] == "off"


def test_pruning_moves_past_a_backlog_of_unfinished_runs(app):
    """A backlog of old unfinished runs does not stop, or slow down, the pruning
    of the finished runs after it: each pass looks at the next window of runs."""
    backlog = define(app, "app.hello", queue="'prune_backlog'")
    app.one("SELECT flow.set_queue('prune_backlog', paused => true)")
    app.one(f"SELECT cardinality(flow.enqueue_many('{backlog}', array_fill('{{}}'::jsonb, array[2500])))")
    name = define(app, "app.hello")
    done = [enqueue(app, name) for _ in range(5)]
    for run in done:
        assert app.await_run(run, "10s")[0] == "succeeded"
    app.wait_for("SELECT max(finished_at) < now() - interval '1.01 s' FROM flow.runs WHERE id = ANY (%s)", done)
    pruned, after, passes = 0, None, 0
    while True:
        n, after = app.all("SELECT pruned, last FROM flow._prune('1 s', 1000, %s)", after)[0]
        pruned, passes = pruned + n, passes + 1
        if after is None:
            break
    assert app.one("SELECT count(*) FROM flow._run_rows WHERE id = ANY (%s)", done) == 0
    assert app.one("SELECT count(*) FROM flow._commands WHERE run_id = ANY (%s)", done) == 0
    assert pruned >= 5 and passes <= app.one("SELECT count(*) FROM flow._run_rows") // 1000 + 2
    assert app.one("SELECT count(*) FROM flow.runs WHERE name = %s AND status = 'running'", backlog) == 2500
    app.all(f"SELECT flow.cancel(r.id) FROM flow.runs r WHERE r.name = '{backlog}'")


def test_pruning_windows_count_a_run_with_a_row_once(app):
    """The pruning window merges the runs with a row of their own (a key) and
    the runs' roots by id: a keyed run, which is in both, is one run of the
    window, deleted with its row, and a window of 3 runs moves on by 3 runs,
    whichever kind they are, until every finished run before the cut is gone."""
    name = define(app, "app.hello")
    runs = [enqueue(app, name, key=f"'{unique('k')}'") if i % 2 else enqueue(app, name) for i in range(9)]
    for run in runs:
        assert app.await_run(run, "10s")[0] == "succeeded"
    keyed = runs[1::2]
    assert app.one("SELECT count(*) FROM flow._runs WHERE id = ANY (%s)", keyed) == 4
    app.wait_for("SELECT max(finished_at) < now() - interval '1.01 s' FROM flow.runs WHERE id = ANY (%s)", runs)
    # (from the first of these runs on, 3 at a time)
    after = app.one("SELECT max(id::text)::uuid FROM flow._run_rows WHERE id < %s", runs[0])
    windows = []
    while True:
        n, last = app.all("SELECT pruned, last FROM flow._prune('1 s', 3, %s)", after)[0]
        windows.append((n, last))
        if last is None or last >= runs[-1]:
            break
        after = last
    assert [n for n, _ in windows] == [3, 3, 3]
    assert [last for _, last in windows] == [runs[2], runs[5], runs[8]]
    assert app.one("SELECT count(*) FROM flow._run_rows WHERE id = ANY (%s)", runs) == 0
    assert app.one("SELECT count(*) FROM flow._commands WHERE run_id = ANY (%s)", runs) == 0
    assert app.one("SELECT count(*) FROM flow._runs WHERE id = ANY (%s)", keyed) == 0


# ---------------------------------------------------------------- retiring events

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


def test_old_events_no_wait_refers_to_are_retired(pg):
    key = unique("old")
    with pg.connect() as c:
        c.execute("ALTER SYSTEM SET flow.event_retention = '1s'")
        c.execute("SELECT pg_reload_conf()")
    try:
        # an event a wait refers to: a child of an external root waits on it, and it comes
        root, child = external(pg), external(pg)
        enqueue(pg, root)
        with pg.connect() as c:
            [(cmd, token, *_)] = claim(c, root)
            waiting = [{"name": child, "key": "c", "waits": [{"name": "keep_me", "key": key}], "within": "1 hour"}]
            c.execute("SELECT flow.complete(%s, %s, NULL, NULL, %s)", (cmd, token, psycopg.types.json.Jsonb(waiting)))
        pg.one("SELECT flow.emit('keep_me', %s)", key)
        assert pg.one("SELECT count(*) FROM flow._waits w JOIN flow._events e ON e.position = w.event_position"
                      " WHERE e.name = 'keep_me' AND e.key = %s", key) == 1
        pg.one("SELECT flow.emit('retire_me', %s)", key)
        pg.wait_for("SELECT count(*) = 0 FROM flow._events WHERE name = 'retire_me' AND key = %s", key, timeout=30)
        # the event a retained wait refers to stays
        assert pg.one("SELECT count(*) FROM flow._events WHERE name = 'keep_me' AND key = %s", key) == 1
        # nothing else may delete from the journal
        pg.one("SELECT flow.emit('retire_me_too', %s)", key)
        assert pg.sqlstate("DELETE FROM flow._events WHERE key = %s", key) == "55000"
    finally:
        with pg.connect() as c:
            c.execute("ALTER SYSTEM RESET flow.event_retention")
            c.execute("SELECT pg_reload_conf()")
