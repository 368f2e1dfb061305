"""Priorities: within a queue, due commands are claimed by (priority, due
time), lower first (sql/claim.sql, flow._claim; a queue's priorities are in _queues.priorities), for
in-database workers and external claims alike."""
import psycopg
import pytest

from conftest import app_cluster, claim, external, poll, priorities_noted, retire_priorities, unique

PRIORITY_APP = """
    -- each run records the order it ran in
    CREATE TABLE app.ran (n serial PRIMARY KEY, tag text, run_id uuid);
    CREATE FUNCTION app.note(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql AS $$
        INSERT INTO app.ran (tag, run_id) VALUES (args->>'tag', ctx.run_id) RETURNING jsonb_build_object('n', n)
    $$;
    -- a root that spawns a child per element of args.children: {"tag":..,"priority":..}
    CREATE FUNCTION app.parent(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE c jsonb;
    BEGIN
        FOR c IN SELECT jsonb_array_elements(args->'children') LOOP
            PERFORM flow.spawn(args->>'child', jsonb_build_object('tag', c->>'tag'), key => c->>'tag',
                               priority => (c->>'priority')::integer);
        END LOOP;
        RETURN '{}';
    END $$;
"""


@pytest.fixture(scope="module")
def pg():
    # (one worker: the order commands start in is the order one claim took them)
    cluster = app_cluster(PRIORITY_APP, conf=("flow.workers = 1",))
    yield cluster
    cluster.stop()


def queue_and_definition(pg, **kw):
    queue, name = unique("q"), unique("note")
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    pg.one(f"SELECT flow.define('{name}', 'app.note'::regproc, queue => '{queue}'{params})")
    pg.one("SELECT flow.set_queue(%s, paused => true)", queue)
    return queue, name


def ran_order(pg, tags):
    pg.wait_for("SELECT count(*) = %s FROM app.ran WHERE tag = ANY (%s)", len(tags), list(tags))
    return [r[0] for r in pg.all("SELECT tag FROM app.ran WHERE tag = ANY (%s) ORDER BY n", list(tags))]


def test_lower_priorities_run_first_whatever_their_due_time(pg):
    queue, name = queue_and_definition(pg, priority=5)
    p = unique("p")
    # enqueued in this order: the definition's priority (5), then overrides
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text))", name, f"{p}-def-1")
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => 9)", name, f"{p}-nine")
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => -2)", name, f"{p}-minus")
    pg.one("SELECT flow.enqueue_many(%s, ARRAY[jsonb_build_object('tag', %s::text), jsonb_build_object('tag', %s::text)],"
           " priority => 0)", name, f"{p}-zero-1", f"{p}-zero-2")
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text))", name, f"{p}-def-2")
    assert pg.all("SELECT priority FROM flow.commands WHERE queue = %s ORDER BY created_at, id", queue) \
        == [(5,), (9,), (-2,), (0,), (0,), (5,)]
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    order = ran_order(pg, [f"{p}-{t}" for t in ("def-1", "nine", "minus", "zero-1", "zero-2", "def-2")])
    assert order == [f"{p}-minus", f"{p}-zero-1", f"{p}-zero-2", f"{p}-def-1", f"{p}-def-2", f"{p}-nine"]


def test_a_childs_priority_comes_from_spawn_or_its_definition(pg):
    queue, child = queue_and_definition(pg, priority=1)
    parent = unique("parent")
    pg.one(f"SELECT flow.define('{parent}', 'app.parent'::regproc)")
    p = unique("k")
    children = [{"tag": f"{p}-a", "priority": 3}, {"tag": f"{p}-b", "priority": None},
                {"tag": f"{p}-c", "priority": -3}]
    run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('child', %s::text, 'children', %s::jsonb))",
                 parent, child, __import__("json").dumps(children))
    pg.wait_for("SELECT count(*) = 3 FROM flow.commands WHERE run_id = %s AND queue = %s", run, queue)
    assert dict(pg.all("SELECT key, priority FROM flow.commands WHERE run_id = %s AND queue = %s", run, queue)) \
        == {f"{p}-a": 3, f"{p}-b": 1, f"{p}-c": -3}
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    assert ran_order(pg, [f"{p}-a", f"{p}-b", f"{p}-c"]) == [f"{p}-c", f"{p}-b", f"{p}-a"]
    assert pg.await_run(run)[0] == "succeeded"


def test_commands_not_yet_due_do_not_hold_back_other_priorities(pg):
    queue, name = queue_and_definition(pg)
    p = unique("later")
    # a backlog of priority 0 not due for an hour, and one due command of priority 7
    pg.one("SELECT flow.enqueue_many(%s, array_fill('{\"tag\": \"x\"}'::jsonb, ARRAY[500]), start_after => '1 hour')",
           name)
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => 7)", name, p)
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    assert ran_order(pg, [p]) == [p]
    assert pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s AND status = 'pending'", queue) == 500


def test_external_claims_take_lower_priorities_first(pg):
    name = external(pg)
    ids = {}
    for tag, priority in (("late", 4), ("first", -1), ("mid", 0), ("second", -1)):
        ids[pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => %s)", name, tag, priority)] = tag
    # (a queue's new priorities are added to it a moment after their commit)
    priorities_noted(pg)
    with pg.connect() as conn:
        rows = claim(conn, name, max_=2)
        assert [r[2]["tag"] for r in rows] == ["first", "second"]
        rows = claim(conn, name, max_=2)
        assert [r[2]["tag"] for r in rows] == ["mid", "late"]


def test_a_transaction_that_noted_a_new_priority_holds_up_no_other_role(pg):
    """A role's open transaction that enqueued the first command of a new
    priority into the shared `default` queue does not hold up another role's
    first command of another new priority there: its enqueue returns at once,
    and it is claimed while the first transaction is still open."""
    pg.one("DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;"
           " EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    hers = external(pg, user="alice", queue="'default'")
    his = external(pg, user="bob", queue="'default'")
    with pg.connect(user="alice", autocommit=False) as alice:
        alice.execute("SELECT flow.enqueue(%s, '{\"tag\": \"hers\"}', priority => 1011)", (hers,))
        with pg.connect(user="bob") as bob:
            bob.execute("SET statement_timeout = '5 s'")
            bob.execute("SELECT flow.enqueue(%s, '{\"tag\": \"his\"}', priority => 1012)", (his,))
            rows = poll(lambda: claim(bob, his), 10.0, what="bob's command claimed")
            assert [r[2]["tag"] for r in rows] == ["his"]
        assert claim(alice, hers) == []   # (her own is not committed)
        alice.commit()
    with pg.connect(user="alice") as alice:
        rows = poll(lambda: claim(alice, hers), 10.0, what="alice's command claimed")
        assert [r[2]["tag"] for r in rows] == ["hers"]
    assert {1011, 1012} <= set(pg.one("SELECT priorities FROM flow._queues WHERE name = 'default'"))


def test_a_bad_priority_is_refused_and_changes_nothing(pg):
    queue, name = queue_and_definition(pg)
    before = pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s", queue)
    assert pg.sqlstate("SELECT flow.enqueue(%s, priority => 40000)", name) == "22003"
    assert pg.sqlstate("SELECT flow.enqueue_many(%s, ARRAY['{}'::jsonb], priority => -40000)", name) == "22003"
    assert pg.sqlstate(f"SELECT flow.define('{unique('d')}', 'app.note'::regproc, priority => 32768)") == "22003"
    assert pg.sqlstate(f"SELECT flow.define('{unique('d')}', 'app.note'::regproc, priority => NULL)") == "22004"
    assert pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s", queue) == before
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0]


def test_a_dropped_queue_forgets_its_priorities(pg):
    queue = unique("q")
    name = unique("note")
    pg.one(f"SELECT flow.define('{name}', 'app.note'::regproc, queue => '{queue}', priority => 3)")
    run = pg.one("SELECT flow.enqueue(%s, '{\"tag\": \"gone\"}')", name)
    assert pg.await_run(run)[0] == "succeeded"
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0, 3]
    pg.one(f"SELECT flow.define('{name}', 'app.note'::regproc, queue => 'default', version => 1)")
    pg.wait_for("SELECT count(*) = 0 FROM flow.commands WHERE queue = %s AND finished_at IS NULL", queue)
    assert pg.one("SELECT flow.drop_queue(%s)", queue) is True
    assert pg.one("SELECT count(*) FROM flow._queues WHERE name = %s", queue) == 0


def test_a_dropped_queue_forgets_the_priorities_not_yet_added_to_it(pg):
    queue, name = unique("q"), unique("note")
    pg.one(f"SELECT flow.define('{name}', 'app.note'::regproc, queue => '{queue}')")
    with pg.connect(autocommit=False) as c:
        run = c.execute("SELECT flow.enqueue(%s, '{}', priority => 6)", (name,)).fetchone()[0]
        assert c.execute("SELECT count(*) FROM flow._priority_notes WHERE queue = %s", (queue,)).fetchone()[0] == 1
        c.execute("SELECT flow.cancel(%s)", (run,))
        c.execute(f"SELECT flow.define('{name}', 'app.note'::regproc, queue => 'default', version => 1)")
        assert c.execute("SELECT flow.drop_queue(%s)", (queue,)).fetchone()[0] is True
        # (a queue made again by that name, before a fold, would have taken it as noted)
        assert c.execute("SELECT count(*) FROM flow._priority_notes WHERE queue = %s", (queue,)).fetchone()[0] == 0
        c.commit()


def test_a_queue_holds_at_most_64_priorities_besides_0(pg):
    queue, name = queue_and_definition(pg)
    for p in range(1, 65):
        pg.one("SELECT flow.enqueue(%s, '{\"tag\": \"cap\"}', priority => %s)", name, p)
    before = pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s", queue)
    assert pg.sqlstate("SELECT flow.enqueue(%s, '{}', priority => 65)", name) == "54000"
    # those in use and 0 are fine
    pg.one("SELECT flow.enqueue(%s, '{\"tag\": \"cap\"}', priority => 7)", name)
    pg.one("SELECT flow.enqueue(%s, '{\"tag\": \"cap\"}')", name)
    assert pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s", queue) == before + 2


def test_the_cap_counts_the_priorities_other_transactions_are_noting(pg):
    """Two transactions noting new priorities in one queue at the same moment
    do not each get 64: the second sees the first's notes before its commit."""
    queue, name = queue_and_definition(pg)
    with pg.connect(autocommit=False) as first:
        for p in range(1, 41):
            first.execute("SELECT flow.enqueue(%s, '{}', priority => %s)", (name, p))
        with pg.connect() as second:
            for p in range(41, 65):
                second.execute("SELECT flow.enqueue(%s, '{}', priority => %s)", (name, p))
            with pytest.raises(psycopg.Error) as caught:
                second.execute("SELECT flow.enqueue(%s, '{}', priority => 65)", (name,))
            assert caught.value.sqlstate == "54000"
        first.rollback()


def test_priorities_no_unfinished_command_has_are_forgotten_and_free_the_cap(pg):
    """A queue whose commands used 64 priorities once is not closed to new
    ones for good: once those commands are done, their priorities go, and a
    priority used again is claimed in its order."""
    queue, name = queue_and_definition(pg)
    p = unique("r")
    for priority in range(1, 65):
        pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => %s)",
               name, f"{p}-{priority}", priority)
    priorities_noted(pg)
    assert pg.sqlstate("SELECT flow.enqueue(%s, '{}', priority => 65)", name) == "54000"
    # the commands of 1..63 end (cancelled); 64's is still pending (the queue is paused)
    assert pg.one("SELECT count(*) FILTER (WHERE flow.cancel(c.run_id)) FROM flow.commands c"
                  " WHERE c.queue = %s AND c.priority < 64", queue) == 63
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0] + list(range(1, 65))
    assert retire_priorities(pg) >= 1
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0, 64]
    # new priorities, and one forgotten, are taken again and claimed in order
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => 65)", name, f"{p}-65")
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => 3)", name, f"{p}-3")
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text))", name, f"{p}-0")
    priorities_noted(pg)
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0, 3, 64, 65]
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    assert ran_order(pg, [f"{p}-{t}" for t in (0, 3, 64, 65)]) == [f"{p}-{t}" for t in (0, 3, 64, 65)]


def test_priorities_of_unfinished_commands_are_kept(pg):
    """Pending (not yet due), waiting, running (an external lease) and
    grouped commands keep their priorities; those of finished ones go."""
    queue, name = queue_and_definition(pg)
    pg.one("SELECT flow.enqueue(%s, '{}', priority => 7, start_after => '1 hour')", name)
    pg.one("SELECT flow.enqueue(%s, '{}', priority => 9, group_key => 'g', start_after => '1 hour')", name)
    done = pg.one("SELECT flow.enqueue(%s, '{}', priority => 10)", name)
    done_grouped = pg.one("SELECT flow.enqueue(%s, '{}', priority => 11, group_key => 'g')", name)
    pg.one("SELECT flow.cancel(%s), flow.cancel(%s)", done, done_grouped)
    ext = external(pg, queue=f"'{queue}'")
    pg.one("SELECT flow.enqueue(%s, '{}', priority => 8)", ext)
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    with pg.connect() as c:
        assert len(poll(lambda: claim(c, ext), 10.0, what="the external command claimed")) == 1
    pg.one("SELECT flow.set_queue(%s, paused => true)", queue)
    assert pg.all("SELECT priorities, grouped_priorities FROM flow._queues WHERE name = %s", queue) \
        == [([0, 7, 8, 9, 10, 11], [9, 11])]
    assert retire_priorities(pg) >= 1
    assert pg.all("SELECT priorities, grouped_priorities FROM flow._queues WHERE name = %s", queue) \
        == [([0, 7, 8, 9], [9])]


def test_a_queue_being_enqueued_into_keeps_its_priorities_until_the_enqueue_ends(pg):
    """An open transaction putting commands in the queue holds its name: the
    queue is skipped, never waited for, and a priority that transaction saw
    in the queue's row is not forgotten under it."""
    queue, name = queue_and_definition(pg)
    run = pg.one("SELECT flow.enqueue(%s, '{}', priority => 4)", name)
    priorities_noted(pg)
    pg.one("SELECT flow.cancel(%s)", run)
    with pg.connect(autocommit=False) as c:
        # (4 is in the queue's row: this enqueue notes nothing, and relies on it)
        again = c.execute("SELECT flow.enqueue(%s, '{}', priority => 4)", (name,)).fetchone()[0]
        with pg.connect() as other:
            other.execute("SET statement_timeout = '5 s'")
            retire_priorities(pg, other)
        assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0, 4]
        c.commit()
    retire_priorities(pg)
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0, 4]
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    assert pg.await_run(again)[0] == "succeeded"


def test_a_transaction_that_read_a_forgotten_priority_in_its_snapshot_notes_it_again(pg):
    """A REPEATABLE READ transaction whose snapshot still has a priority the
    maintenance worker forgot since notes it again when it enqueues into the
    queue: its command is claimed, not left where no claim reads."""
    queue, name = queue_and_definition(pg)
    run = pg.one("SELECT flow.enqueue(%s, '{}', priority => 5)", name)
    priorities_noted(pg)
    pg.one("SELECT flow.cancel(%s)", run)
    with pg.connect(autocommit=False) as c:
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert c.execute("SELECT priorities FROM flow._queues WHERE name = %s", (queue,)).fetchone()[0] == [0, 5]
        assert retire_priorities(pg) >= 1
        assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0]
        again = c.execute("SELECT flow.enqueue(%s, '{}', priority => 5)", (name,)).fetchone()[0]
        c.execute("SELECT flow.enqueue(%s, '{}', priority => 5)", (name,))
        assert c.execute("SELECT count(*) FROM flow._priority_notes WHERE queue = %s", (queue,)).fetchone()[0] == 1
        c.commit()
    priorities_noted(pg)
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0, 5]
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    assert pg.await_run(again)[0] == "succeeded"


def test_a_due_command_whose_priority_its_queue_lacks_is_noted_again(pg):
    """The net under the retirement (flow._renote_stranded_priorities, at the
    start of each pass): a command its queue's row does not list the
    priority of, as after a `pg_restore -j` that loaded the commands after
    a pass looked, is claimed a pass later instead of never."""
    queue, name = queue_and_definition(pg)
    p = unique("s")
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => 5)", name, f"{p}-5")
    pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => 6, group_key => 'g')",
           name, f"{p}-6")
    priorities_noted(pg)
    pg.one("UPDATE flow._queues SET priorities = '{0}', grouped_priorities = '{}' WHERE name = %s", queue)
    assert pg.one("SELECT flow._renote_stranded_priorities()") == 2
    assert pg.one("SELECT flow._renote_stranded_priorities()") == 0   # (noted already)
    priorities_noted(pg)
    assert pg.all("SELECT priorities, grouped_priorities FROM flow._queues WHERE name = %s", queue) \
        == [([0, 5, 6], [6])]
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    assert ran_order(pg, [f"{p}-5", f"{p}-6"]) == [f"{p}-5", f"{p}-6"]


def test_no_priority_is_forgotten_while_the_database_has_over_1000_external_definitions(pg):
    """Each queue's look probes a lane per external definition, under the
    queue's name lock: past 1,000 no pass is made (priorities are kept, as
    before 0.3.0), so no role can stall enqueues by defining many.
    (Last in this module: the definitions stay.)"""
    queue, name = queue_and_definition(pg)
    run = pg.one("SELECT flow.enqueue(%s, '{}', priority => 13)", name)
    priorities_noted(pg)
    pg.one("SELECT flow.cancel(%s)", run)
    prefix = unique("many")
    pg.one("SELECT count(flow.define(%s || i, NULL)) FROM generate_series(1, 1001) i", prefix)
    assert retire_priorities(pg) == 0
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0, 13]
