"""Workflows: children spawned by handlers, waits on events, events from
the journal, run outcomes, sagas that compensate, run graphs. (A workflow's
cancel: test_cancel.py; workers killed under workflows: test_crash.py; event
retention: test_retention.py.)"""
import subprocess
import time

import pytest

from conftest import assert_fan_outs_ran_once, ACT, ACT_APP, WORKFLOW_APP, app_cluster, commands, define, effects, enqueue, root, unique


@pytest.fixture(scope="module")
def pg():
    """The workflows' definitions ('fan_root', 'wait_root', 'respawn', 'leaf',
    'doomed', ...) and app.act."""
    cluster = app_cluster(WORKFLOW_APP, ACT_APP, conf=("flow.workers = 2", "flow.batch_size = 50"))
    yield cluster
    cluster.stop()


# ---------------------------------------------------------------- await

def test_await_returns_as_soon_as_its_run_ends(pg):
    """flow.await is woken by the commit that ends its run, not by its next
    poll (every 50 ms at most: it returned up to 50 ms late)."""
    import threading
    q = unique("q")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")
    name = define(pg, ACT, queue=f"'{q}'")
    lags = []
    for _ in range(8):
        run = enqueue(pg, name)
        returned = {}

        def wait():
            returned["status"] = pg.await_run(run, "10s")[0]
            returned["at"] = time.monotonic()

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.6)   # (long past the first polls: a poll would now come every 50 ms)
        pg.one("SELECT flow.cancel(%s)", run)
        cancelled_at = time.monotonic()
        waiter.join(10)
        assert returned["status"] == "cancelled"
        lags.append(returned["at"] - cancelled_at)
    # (measured after the cancel's connection closed: a few ms past its
    # commit; polling gave a median of 14 ms here, the wake-up under 1 ms)
    assert sorted(lags)[2] < 0.006, lags


# ---------------------------------------------------------------- fan-out and fan-in

def test_fan_out_fan_in_once(pg):
    run = pg.one("SELECT flow.enqueue('fan_root', '{\"n\": 50}')")
    status, result, _ = pg.await_run(run, "60s")
    assert status == "succeeded" and result == {"spawned": 50}
    join = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'join'", run)
    assert join == {"inputs": 50, "sum": 1275, "timed_out": False}
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s", run) == 51


def test_one_hundred_concurrent_fan_outs(pg):
    runs = pg.one("SELECT flow.enqueue_many('fan_root', array_fill('{\"n\": 50}'::jsonb, array[100]))")
    pg.wait_for("SELECT count(*) = 100 FROM flow.runs WHERE id = ANY(%s) AND status <> 'running'", runs,
                timeout=240)
    # every part and join ran exactly once per run
    assert_fan_outs_ran_once(pg, runs, 50)


# ---------------------------------------------------------------- waits and events

def test_event_before_the_wait_is_read_from_the_journal(pg):
    key = unique("early")
    pg.one("SELECT flow.emit('evt2', %s, '{\"n\": 2}')", key)
    pg.one("SELECT flow.emit('evt', %s, '{\"n\": 1}')", key)
    run = pg.one("SELECT flow.enqueue('wait_root', jsonb_build_object('key', %s::text, 'within', '1 minute'))", key)
    assert pg.await_run(run, "20s")[0] == "succeeded"
    child = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'child'", run)
    assert child["timed_out"] is False and child["missing"] == []
    # in (name, key) order, not in the order the events came
    assert [(i["name"], i["payload"]["n"]) for i in child["inputs"]] == [("evt", 1), ("evt2", 2)]


def test_event_after_the_wait_wakes_it(pg):
    key = unique("late")
    run = pg.one("SELECT flow.enqueue('wait_root', jsonb_build_object('key', %s::text, 'within', '1 minute'))", key)
    pg.wait_for("SELECT status = 'waiting' FROM flow.commands WHERE run_id = %s AND key = 'child'", run)
    pg.one("SELECT flow.emit('evt', %s, '{\"n\": 1}')", key)
    time.sleep(0.3)   # (time itself: one of two waits satisfied does not wake it)
    assert commands(pg, run)["child"] == "waiting"  # one of two waits satisfied
    t0 = time.time()
    pg.one("SELECT flow.emit('evt2', %s, '{\"n\": 2}')", key)
    assert pg.await_run(run, "20s")[0] == "succeeded"
    assert time.time() - t0 < 2
    child = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'child'", run)
    assert child["timed_out"] is False and len(child["inputs"]) == 2
    satisfied = pg.all("SELECT name FROM flow.events WHERE key = %s AND cardinality(satisfied_waits) = 1"
                       " ORDER BY name", key)
    assert satisfied == [("evt",), ("evt2",)]


def test_wait_timeout_runs_the_child_with_what_arrived(pg):
    key = unique("never")
    run = pg.one("SELECT flow.enqueue('wait_root', jsonb_build_object('key', %s::text, 'within', '600 ms'))", key)
    pg.wait_for("SELECT status = 'waiting' FROM flow.commands WHERE run_id = %s AND key = 'child'", run)
    pg.one("SELECT flow.emit('evt', %s, '{\"n\": 1}')", key)
    assert pg.await_run(run, "20s")[0] == "succeeded"
    child = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'child'", run)
    assert child["timed_out"] is True
    assert [i["name"] for i in child["inputs"]] == ["evt"]
    assert child["missing"] == [{"name": "evt2", "key": key}]


def test_spawn_with_null_waits_runs_the_child(pg):
    child = define(pg, ACT)
    run = enqueue(pg, define(pg, ACT), f'{{"do": "spawn_no_waits", "child": "{child}"}}')
    assert pg.await_run(run)[0] == "succeeded"


def test_a_wait_without_within_ends_at_the_run_deadline(pg):
    child = define(pg, ACT)
    run = enqueue(pg, define(pg, ACT), f'{{"do": "spawn_waiting", "child": "{child}"}}', deadline="'2 seconds'")
    status, _, error = pg.await_run(run, "15s")
    assert status == "failed"
    assert pg.one("SELECT stop_reason FROM flow._commands WHERE run_id = %s AND key = 'child'", run) in (
        "deadline_before_next_attempt", "attempt_limit")


def test_only_the_workflows_roles_can_satisfy_its_waits(pg):
    pg.all("DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;"
           " EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    pg.all("GRANT USAGE ON SCHEMA app TO alice")
    pg.all("CREATE FUNCTION app.alice_root(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$ BEGIN"
           " PERFORM flow.spawn('alice_child', '{}', key => 'child',"
           "   waits => array[flow.wait('secret', args->>'key')]); RETURN NULL; END $$")
    pg.all("CREATE FUNCTION app.alice_child(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql AS"
           " $$ SELECT ctx.inputs $$")
    pg.all("ALTER FUNCTION app.alice_root(jsonb) OWNER TO alice")
    pg.all("ALTER FUNCTION app.alice_child(jsonb, flow.context) OWNER TO alice")
    pg.one("SELECT flow.define('alice_root', 'app.alice_root'::regproc)", user="alice")
    pg.one("SELECT flow.define('alice_child', 'app.alice_child'::regproc)", user="alice")
    key = unique("k")
    pg.one("SELECT flow.emit('secret', %s, '{\"from\": \"bob, early\"}')", key, user="bob")
    run = pg.one("SELECT flow.enqueue('alice_root', jsonb_build_object('key', %s::text))", key, user="alice")
    pg.wait_for("SELECT status = 'waiting' FROM flow.commands WHERE run_id = %s AND key = 'child'", run,
                user="alice")
    pg.one("SELECT flow.emit('secret', %s, '{\"from\": \"bob\"}')", key, user="bob")
    time.sleep(0.5)   # (time itself: bob's event does not wake alice's wait)
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s AND key = 'child'", run,
                  user="alice") == "waiting"
    pg.one("SELECT flow.emit('secret', %s, '{\"from\": \"alice\"}')", key, user="alice")
    assert pg.await_run(run, "10s", user="alice")[0] == "succeeded"
    inputs = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'child'", run, user="alice")
    assert [i["payload"] for i in inputs] == [{"from": "alice"}]


# ---------------------------------------------------------------- spawn: children once, and invalid spawns

def test_await_refuses_a_run_its_transaction_cannot_see_end(pg):
    """A run enqueued by the awaiting transaction cannot end before it
    commits, and a REPEATABLE READ snapshot never sees a run end: flow.await
    waited out its whole timeout for either. Now it refuses at once (55000)."""
    import psycopg
    name = define(pg, "flow.noop")
    with pg.connect(autocommit=False) as c:
        run = c.execute(f"SELECT flow.enqueue('{name}')").fetchone()[0]
        started = time.monotonic()
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            c.execute("SELECT flow.await(%s, '5 s')", (run,))
        assert time.monotonic() - started < 1
    q = unique("q")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")   # (the run stays running)
    run = enqueue(pg, define(pg, "flow.noop", queue=f"'{q}'"))
    with pg.connect(autocommit=False) as c:
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            c.execute("SELECT flow.await(%s, '5 s')", (run,))
    # an ended run is answered in any transaction
    done = enqueue(pg, name)
    assert pg.await_run(done, "20s")[0] == "succeeded"
    with pg.connect(autocommit=False) as c:
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        assert c.execute("SELECT (flow.await(%s, '5 s')).status", (done,)).fetchone()[0] == "succeeded"
    pg.one("SELECT flow.cancel(%s)", run)


def test_a_retried_spawner_does_not_duplicate_children(pg):
    run = pg.one("SELECT flow.enqueue('respawn')")
    assert pg.await_run(run, "20s")[0] == "succeeded"
    assert pg.one("SELECT attempts FROM flow.commands WHERE run_id = %s AND key = 'root'", run) == 2
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = %s AND key = 'leaf'", run) == 1
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s", run) == 1


def spawner(pg, child, n):
    """A new definition whose handler spawns n commands of `child`, keyed c1..cn."""
    function = unique("spawner")
    pg.one(f"""CREATE FUNCTION app.{function}(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
               BEGIN
                   FOR i IN 1..{n} LOOP
                       PERFORM flow.spawn('{child}', '{{}}', key => 'c' || i);
                   END LOOP;
                   RETURN NULL;
               END $$""")
    return define(pg, f"app.{function}")


def test_spawns_take_no_transaction_id_each(pg):
    """A handler's spawns write in its own (sub)transaction: each took one of
    its own (an exception block around the insert), and past 64 of them every
    snapshot in the server overflowed while the handler ran."""
    q = unique("q")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)")   # (the children wait: their runs take no ids)
    name = spawner(pg, define(pg, ACT, queue=f"'{q}'"), 100)
    before = int(pg.one("SELECT pg_current_xact_id()::text"))
    run = enqueue(pg, name)
    pg.wait_for("SELECT count(*) = 100 FROM flow.commands WHERE run_id = %s AND key LIKE 'c%%'", run)
    # the enqueue, the claim, the handler's chunk and its subtransaction, this
    # query: a few ids, not one per spawn
    assert int(pg.one("SELECT pg_current_xact_id()::text")) - before < 20
    pg.one("SELECT flow.cancel(%s)", run)


def test_a_fan_out_of_fast_children_runs_without_waiting_for_the_claims_cursors(pg):
    """The children of a run are held by one worker's chunk at a time, with
    the run's lock. The other workers' claims locked some of them, could not
    lock the run and left them out, still locked: the claims of the worker
    holding the run went on after them, and they waited a second for the
    claims' cursors to run out (1,000 no-op children took 0.4-2 s, in stretches
    a second apart). Now those claims leave the run's commands alone
    (shmem::publish_busy_runs), and a command one still leaves out is due again
    at its end (flow._left_behind): the children end without such a gap.
    (One fan-out in about 25 in this module still had one: a worker took up
    another's published cursor, made before children were made due again
    behind it, after its own claim had taken that note; now a note expires
    the published cursors it could pass, shmem::note_due_again.)"""
    q = unique("q")
    name = spawner(pg, define(pg, "flow.noop", queue=f"'{q}'"), 1000)
    gaps = []
    for _ in range(8):
        run = enqueue(pg, name)
        assert pg.await_run(run, "60s")[0] == "succeeded"
        ends = [row[0] for row in pg.all("SELECT extract(epoch FROM finished_at)::float8 FROM flow.commands"
                                          " WHERE run_id = %s ORDER BY finished_at", run)]
        assert len(ends) == 1001
        gaps.append(round(max(b - a for a, b in zip(ends, ends[1:])), 3))
    assert max(gaps) < 0.5, f"the children of fan-outs ended with gaps of {gaps} s"


def test_a_root_that_spawns_in_its_first_attempt_ends_its_run_only_with_its_child(pg):
    # A root in its first attempt is taken to have no child without a look
    # (flow._claim, flow._settle_batch's `alone`) unless its chunk spawned:
    # a root that spawns in that attempt must leave its run running.
    children, roots = unique("late_child"), unique("first_spawner")
    pg.one(f"SELECT flow.set_queue('{children}', paused => true)")
    pg.one(f"SELECT flow.define('{children}', 'app.leaf'::regproc, queue => '{children}')")
    pg.all(f"""CREATE FUNCTION app.{roots}(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
                   BEGIN PERFORM flow.spawn('{children}', '{{}}', key => 'child'); RETURN '{{"root": 1}}'; END $$""")
    pg.one(f"SELECT flow.define('{roots}', 'app.{roots}'::regproc)")
    succeeded = "SELECT value FROM flow.stats WHERE name = 'runs_succeeded'"
    before = pg.one(succeeded)
    runs = pg.one(f"SELECT flow.enqueue_many('{roots}', array_fill('{{}}'::jsonb, array[40]))")
    pg.wait_for("SELECT count(*) = 40 FROM flow.commands WHERE run_id = ANY(%s) AND key = 'root'"
                " AND status = 'succeeded' AND attempts = 1", runs)
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY(%s) AND status = 'running'", runs) == 40
    assert pg.one(succeeded) == before
    pg.one(f"SELECT flow.set_queue('{children}', paused => false)")
    pg.wait_for("SELECT count(*) = 40 FROM flow.runs WHERE id = ANY(%s) AND status = 'succeeded'", runs)
    assert pg.one("SELECT count(DISTINCT result) FROM flow.runs WHERE id = ANY(%s)", runs) == 1
    assert pg.one("SELECT result FROM flow.runs WHERE id = %s", runs[0]) == {"root": 1}
    pg.wait_for(f"SELECT ({succeeded}) = %s", before + 40)


def test_a_conflicting_respawn_is_an_invalid_decision(pg):
    run = pg.one("SELECT flow.enqueue('respawn', '{\"conflict\": true}')")
    status, _, error = pg.await_run(run, "20s")
    assert status == "failed" and error["code"] == "invalid_decision" and error["stop_reason"] == "permanent"
    assert pg.one("SELECT attempts FROM flow.commands WHERE run_id = %s AND key = 'root'", run) == 1
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = %s", run) == 1  # the child rolled back


def test_spawning_the_root_key_is_an_invalid_decision(pg):
    """'root' is the root command's key, and the root's id is its run's (it
    has no entry in the index of the run's other keys): spawning it is an
    invalid decision, as spawning any key with another declaration."""
    run = pg.one("SELECT flow.enqueue('respawn', '{\"root_key\": true}')")
    status, _, error = pg.await_run(run, "20s")
    assert status == "failed" and error["code"] == "invalid_decision" and error["stop_reason"] == "permanent"
    assert "child key root" in error["message"]
    assert pg.all("SELECT id, key FROM flow.commands WHERE run_id = %s", run) == [(run, "root")]


def many_spawner(pg, child, body):
    """A new definition whose handler runs `body` (PL/pgSQL, `child` is the
    children's definition) and returns {"ids": what it set `ids` to}."""
    function = unique("many_spawner")
    pg.one(f"""CREATE FUNCTION app.{function}(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
               DECLARE ids uuid[]; again uuid[]; child text := '{child}';
               BEGIN {body}; RETURN jsonb_build_object('ids', to_jsonb(ids)); END $$""")
    return define(pg, f"app.{function}")


def test_spawn_many_adds_each_child_once_in_the_order_given(pg):
    """flow.spawn_many spawns one child per args, under the key at the same
    place; spawning the same keys again returns the same ids (a retried
    spawner), and the run ends with its children."""
    child = define(pg, "app.leaf")
    name = many_spawner(pg, child, """
        ids := flow.spawn_many(child, array['{"i": 1}', '{"i": 2}', '{"i": 3}']::jsonb[], array['a', 'b', 'c']);
        again := flow.spawn_many(child, array['{"i": 3}', '{"i": 1}']::jsonb[], array['c', 'a']);
        IF again <> array[ids[3], ids[1]] THEN RAISE EXCEPTION 'a re-spawn returned %, not %', again, ids; END IF;
        IF flow.spawn(child, '{"i": 2}', key => 'b') <> ids[2] THEN RAISE EXCEPTION 'spawn and spawn_many differ'; END IF;
        IF flow.spawn_many(child, '{}', '{}') <> '{}' THEN RAISE EXCEPTION 'nothing to spawn spawned'; END IF""")
    run = enqueue(pg, name)
    status, result, error = pg.await_run(run, "20s")
    assert status == "succeeded", error
    rows = pg.all("SELECT id, key, args FROM flow.commands WHERE run_id = %s AND key <> 'root'", run)
    by_key = {key: (str(id), args) for id, key, args in rows}
    assert sorted(by_key) == ["a", "b", "c"]
    assert result["ids"] == [by_key[k][0] for k in "abc"]
    assert [by_key[k][1] for k in "abc"] == [{"i": 1}, {"i": 2}, {"i": 3}]
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = %s AND status = 'succeeded'", run) == 4


def test_spawn_many_children_wait_for_one_event_each(pg):
    """Children spawned together with waits each wait; one event satisfies
    every one of them, and each runs once."""
    child = define(pg, "app.leaf")
    name = many_spawner(pg, child, """
        ids := flow.spawn_many(child, array['{"i": 1}', '{"i": 2}', '{"i": 3}']::jsonb[], array['w1', 'w2', 'w3'],
                               waits => array[flow.wait('go', args->>'k')], within => '1 minute')""")
    key = unique("go")
    run = enqueue(pg, name, f'{{"k": "{key}"}}')
    pg.wait_for("SELECT count(*) = 3 FROM flow.commands WHERE run_id = %s AND status = 'waiting'", run)
    assert pg.one("SELECT count(*) FROM flow.waits w JOIN flow.commands c ON c.id = w.command_id"
                  " WHERE c.run_id = %s AND w.name = 'go' AND w.key = %s", run, key) == 3
    pg.one("SELECT flow.emit('go', %s, '{}')", key)
    assert pg.await_run(run, "20s")[0] == "succeeded"
    assert pg.all("SELECT key, attempts FROM flow.commands WHERE run_id = %s AND key <> 'root' ORDER BY key",
                  run) == [("w1", 1), ("w2", 1), ("w3", 1)]


def test_spawn_many_puts_each_child_in_its_group(pg):
    """group_keys gives each child the group at its place (NULL: none), as
    enqueue_many's; a re-spawn in another group is another declaration."""
    child = define(pg, "app.leaf")
    name = many_spawner(pg, child, """
        ids := flow.spawn_many(child, array['{}', '{}', '{}']::jsonb[], array['a', 'b', 'c'],
                               group_keys => array['g1', 'g2', NULL]);
        again := flow.spawn_many(child, array['{}']::jsonb[], array['a'], group_key => 'g1');
        IF again[1] <> ids[1] THEN RAISE EXCEPTION 'the same declaration was not a no-op'; END IF;
        BEGIN
            PERFORM flow.spawn_many(child, array['{}']::jsonb[], array['b'], group_key => 'g1');
            RAISE EXCEPTION 'another group was taken for the same declaration';
        EXCEPTION WHEN SQLSTATE 'FL016' THEN NULL;
        END""")
    run = enqueue(pg, name)
    status, _, error = pg.await_run(run, "20s")
    # (the conflicting re-spawn was caught, but an invalid spawn fails its spawner all the same)
    assert status == "failed" and error["code"] == "invalid_decision", error
    enqueue_ok = many_spawner(pg, child, """
        ids := flow.spawn_many(child, array['{}', '{}', '{}']::jsonb[], array['a', 'b', 'c'],
                               group_keys => array['g1', 'g2', NULL])""")
    run = enqueue(pg, enqueue_ok)
    assert pg.await_run(run, "20s")[0] == "succeeded"
    assert pg.all("SELECT key, group_key, group_hash <> 0 FROM flow._commands WHERE run_id = %s AND key <> 'root'"
                  " ORDER BY key", run) == [("a", "g1", True), ("b", "g2", True), ("c", None, False)]


@pytest.mark.parametrize("call, code, words", [
    ("flow.spawn_many(child, array['{}', '{}']::jsonb[], array['a'])", "invalid_decision", "as many keys (1) as args (2)"),
    ("flow.spawn_many(child, array['{}']::jsonb[], NULL)", "invalid_decision", "needs args_array and keys"),
    ("flow.spawn_many(child, array['{}', '{}']::jsonb[], array['a', NULL])", "invalid_decision",
     "keys[2] must not be NULL"),
    ("flow.spawn_many(child, array['{}', '[1]']::jsonb[], array['a', 'b'])", "invalid_decision",
     "args_array[2] must be a JSON object"),
    ("flow.spawn_many(child, '[0:1]={\"{}\",\"{}\"}'::jsonb[], '[0:1]={a,b}'::text[])", "invalid_decision",
     "arrays of one dimension, from index 1"),
    ("flow.spawn_many(child, array[['{}'], ['{}']]::jsonb[], array['a', 'b'])", "invalid_decision",
     "arrays of one dimension, from index 1"),
    ("flow.spawn_many(child, array['{}']::jsonb[], array['a'], group_keys => '[0:0]={\" \"}'::text[])",
     "invalid_decision", "arrays of one dimension, from index 1"),
    ("flow.spawn_many(child, array['{}', '{}']::jsonb[], array['a', 'b'], group_keys => array[['g1'], ['g2']])",
     "invalid_decision", "arrays of one dimension, from index 1"),
    ("flow.spawn_many(child, array['{}']::jsonb[], array['root'])", "invalid_decision", "child key root"),
    ("flow.spawn_many(child, array['{\"i\": 1}', '{\"i\": 2}']::jsonb[], array['k', 'k'])", "invalid_decision",
     "child key k was already spawned with another declaration"),
    ("flow.spawn_many('no_such_definition', array['{}']::jsonb[], array['a'])", "invalid_decision", "no_such_definition"),
    ("flow.spawn_many(child, array['{}']::jsonb[], array['a'], group_key => 'g', group_keys => array['g'])",
     "invalid_decision", "give group_key or group_keys, not both"),
    ("flow.spawn_many(child, array['{}']::jsonb[], array['a'], group_keys => array['g', 'h'])", "invalid_decision",
     "group_keys has 2 elements, keys 1"),
    ("flow.spawn_many(child, array['{}', '{}']::jsonb[], array['a', 'b'], group_keys => array['g', ' '])",
     "invalid_decision", "group_keys[2] must not be empty"),
])
def test_an_invalid_spawn_many_fails_its_spawner_and_spawns_nothing(pg, call, code, words):
    """Each bad input of spawn_many is an invalid decision, as a bad spawn:
    the spawner fails permanently, with the error's message, and none of the
    children of the call (nor of the attempt) is kept."""
    child = define(pg, "app.leaf")
    name = many_spawner(pg, child, f"ids := flow.spawn_many(child, array['{{}}']::jsonb[], array['first']); ids := {call}")
    run = enqueue(pg, name)
    status, _, error = pg.await_run(run, "20s")
    assert status == "failed" and error["code"] == code and error["stop_reason"] == "permanent", error
    assert words in error["message"], error
    assert pg.all("SELECT key FROM flow.commands WHERE run_id = %s", run) == [("root",)]


def test_spawn_many_outside_a_handler_is_refused(pg):
    child = define(pg, "app.leaf")
    assert pg.sqlstate(f"SELECT flow.spawn_many('{child}', array['{{}}']::jsonb[], array['a'])") == "FL012"


# ---------------------------------------------------------------- run outcomes and sagas

def test_a_child_failure_fails_the_run_and_cancels_siblings(pg):
    run = pg.one("SELECT flow.enqueue('doomed', '{\"fail_after\": \"200 ms\"}')")
    status, _, error = pg.await_run(run, "20s")
    assert status == "failed" and error["command_key"] == "bad" and error["message"] == "leaf failed"
    assert commands(pg, run) == {"root": "succeeded", "bad": "failed", "waits": "cancelled", "later": "cancelled"}
    assert pg.one("SELECT stop_reason FROM flow.commands WHERE run_id = %s AND key = 'waits'", run) == "run_failed"


def test_fail_keeping_writes_commits_the_compensation(pg):
    tag = unique("order")
    run = enqueue(pg, define(pg, ACT), f'{{"do": "compensate", "tag": "{tag}"}}')
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


# ---------------------------------------------------------------- run graphs

def test_run_graph_renders_with_dot(pg, tmp_path):
    run = pg.one("SELECT flow.enqueue('wait_root', jsonb_build_object('key', 'graph', 'within', '1 minute'))")
    pg.one("SELECT flow.emit('evt', 'graph')")
    pg.wait_for("SELECT status = 'waiting' FROM flow.commands WHERE run_id = %s AND key = 'child'", run)
    dot = pg.one("SELECT flow.run_graph(%s, 'dot')", run)
    assert "waiting for evt2/graph" in dot and "satisfies" in dot
    svg = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), capture_output=True, check=True).stdout
    assert b"<svg" in svg and b"wait_child" in svg
    mermaid = pg.one("SELECT flow.run_graph(%s, 'mermaid')", run)
    assert mermaid.startswith("flowchart LR") and "-.->" in mermaid
    assert pg.sqlstate("SELECT flow.run_graph(%s, 'png')", run) == "FL003"
    pg.one("SELECT flow.cancel(%s)", run)
