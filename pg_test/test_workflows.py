"""Workflows: events, children that wait on events, run outcomes, run graphs."""
import os
import random
import signal
import subprocess
import time

import psycopg
import pytest

from conftest import fresh_cluster, unique


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2", "flow.batch_size = 50")
    with cluster.connect() as c:
        c.execute("""
            CREATE SCHEMA app;
            CREATE TABLE app.effects (run_id uuid, key text, attempt int);

            -- fan-out/fan-in: root spawns n parts and a join waiting on all their events
            CREATE FUNCTION app.fan_root(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            DECLARE
                n int := (args->>'n')::int;
                waits flow.wait_spec[] := '{}';
            BEGIN
                FOR i IN 1..n LOOP
                    PERFORM flow.spawn('fan_part', jsonb_build_object('i', i), key => 'part-' || i);
                    waits := waits || flow.wait('part_done', ctx.run_id || '/' || i);
                END LOOP;
                PERFORM flow.spawn('fan_join', '{}', key => 'join', waits => waits, within => '2 minutes');
                RETURN jsonb_build_object('spawned', n);
            END $$;
            CREATE FUNCTION app.fan_part(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects VALUES (ctx.run_id, ctx.command_key, ctx.attempt);
                PERFORM flow.emit('part_done', ctx.run_id || '/' || (args->>'i'), jsonb_build_object('i', args->'i'));
                RETURN NULL;
            END $$;
            CREATE FUNCTION app.fan_join(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects VALUES (ctx.run_id, ctx.command_key, ctx.attempt);
                RETURN jsonb_build_object('inputs', jsonb_array_length(ctx.inputs),
                    'sum', (SELECT sum((x->'payload'->>'i')::int) FROM jsonb_array_elements(ctx.inputs) x),
                    'timed_out', ctx.wait_timed_out);
            END $$;

            -- a parent that spawns one child waiting on (event, key) with a short `within`
            CREATE FUNCTION app.wait_root(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM flow.spawn('wait_child', '{}', key => 'child',
                    waits => array[flow.wait('evt', args->>'key'), flow.wait('evt2', args->>'key')],
                    within => (args->>'within')::interval);
                RETURN NULL;
            END $$;
            CREATE FUNCTION app.wait_child(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql AS $$
                SELECT jsonb_build_object('inputs', ctx.inputs, 'timed_out', ctx.wait_timed_out, 'missing', ctx.missing)
            $$;

            -- spawns a child, then fails on its first attempt: the retry re-spawns it
            CREATE FUNCTION app.respawn(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM flow.spawn('leaf', '{"x": 1}', key => 'leaf');
                PERFORM flow.spawn('leaf', '{"x": 1}', key => 'leaf');   -- same declaration: a no-op
                IF args ? 'conflict' THEN
                    PERFORM flow.spawn('leaf', '{"x": 2}', key => 'leaf');
                END IF;
                IF args ? 'root_key' THEN
                    PERFORM flow.spawn('leaf', '{}', key => 'root');
                END IF;
                IF ctx.attempt = 1 THEN RAISE EXCEPTION 'first attempt fails'; END IF;
                RETURN NULL;
            END $$;
            CREATE FUNCTION app.leaf(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects VALUES (ctx.run_id, ctx.command_key, ctx.attempt);
                IF args ? 'fail' THEN PERFORM flow.fail('leaf failed'); END IF;
                IF args ? 'sleep' THEN PERFORM pg_sleep((args->>'sleep')::float); END IF;
                RETURN NULL;
            END $$;
            -- a parent with one failing child and siblings that wait or sleep
            CREATE FUNCTION app.doomed(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM flow.spawn('leaf', '{"fail": true}', key => 'bad', start_after => (args->>'fail_after')::interval);
                PERFORM flow.spawn('leaf', '{}', key => 'waits', waits => array[flow.wait('never', 'x')]);
                PERFORM flow.spawn('leaf', '{}', key => 'later', start_after => '1 hour');
                RETURN NULL;
            END $$;
        """)
        for name, fn in [("fan_root", "app.fan_root"), ("fan_part", "app.fan_part"), ("fan_join", "app.fan_join"),
                         ("wait_root", "app.wait_root"), ("wait_child", "app.wait_child"),
                         ("respawn", "app.respawn"), ("leaf", "app.leaf"), ("doomed", "app.doomed")]:
            c.execute(f"SELECT flow.define('{name}', '{fn}'::regproc, max_attempts => 20, backoff => '10 ms',"
                      " backoff_max => '100 ms')")
    yield cluster
    cluster.stop()


def commands(pg, run):
    return dict(pg.all("SELECT key, status FROM flow.commands WHERE run_id = %s", run))


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
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY(%s) AND status = 'succeeded'", runs) == 100
    # every part and join ran exactly once per run
    assert pg.one("SELECT count(*) FROM (SELECT run_id, key FROM app.effects WHERE run_id = ANY(%s)"
                  " GROUP BY run_id, key HAVING count(*) <> 1) x", runs) == 0
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = ANY(%s)", runs) == 100 * 51
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = ANY(%s) AND key = 'join'"
                  " AND result->>'inputs' = '50'", runs) == 100


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
    time.sleep(0.3)
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


def test_a_retried_spawner_does_not_duplicate_children(pg):
    run = pg.one("SELECT flow.enqueue('respawn')")
    assert pg.await_run(run, "20s")[0] == "succeeded"
    assert pg.one("SELECT attempts FROM flow.commands WHERE run_id = %s AND key = 'root'", run) == 2
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = %s AND key = 'leaf'", run) == 1
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s", run) == 1


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


def test_a_child_failure_fails_the_run_and_cancels_siblings(pg):
    run = pg.one("SELECT flow.enqueue('doomed', '{\"fail_after\": \"200 ms\"}')")
    status, _, error = pg.await_run(run, "20s")
    assert status == "failed" and error["command_key"] == "bad" and error["message"] == "leaf failed"
    assert commands(pg, run) == {"root": "succeeded", "bad": "failed", "waits": "cancelled", "later": "cancelled"}
    assert pg.one("SELECT stop_reason FROM flow.commands WHERE run_id = %s AND key = 'waits'", run) == "run_failed"


def test_cancel_cancels_waiting_children_and_nothing_runs_after(pg):
    run = pg.one("SELECT flow.enqueue('doomed', '{\"fail_after\": \"1 hour\"}')")
    pg.wait_for("SELECT count(*) = 4 FROM flow.commands WHERE run_id = %s", run)
    pg.wait_for("SELECT status = 'succeeded' FROM flow.commands WHERE run_id = %s AND key = 'root'", run)
    assert pg.one("SELECT flow.cancel(%s)", run) is True
    assert commands(pg, run) == {"root": "succeeded", "bad": "cancelled", "waits": "cancelled",
                                 "later": "cancelled"}
    pg.one("SELECT flow.emit('never', 'x')")
    time.sleep(0.5)
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s", run) == 0
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "cancelled"


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


@pytest.mark.parametrize("call,code", [
    ("flow.spawn('leaf', '{}', key => 'x')", "FL012"),
    ("flow.emit(NULL, 'k')", "FL002"),
    ("flow.emit('e', NULL)", "FL002"),
    ("flow.emit('e', 'k', jsonb_build_object('big', repeat('x', 300000)))", "FL004"),
])
def test_bad_workflow_input(pg, call, code):
    before = pg.one("SELECT count(*) FROM flow._events")
    assert pg.sqlstate("SELECT " + call) == code
    assert pg.one("SELECT count(*) FROM flow._events") == before


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
                time.sleep(1.0)
                pg.wait_ready()
            time.sleep(rng.uniform(0.3, 1.0))
        except (psycopg.OperationalError, ProcessLookupError):
            time.sleep(0.5)
            pg.wait_ready()
    assert kills >= 1
    pg.wait_for("SELECT count(*) = 0 FROM flow.runs WHERE id = ANY(%s) AND status = 'running'", runs, timeout=240)
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY(%s) AND status = 'succeeded'", runs) == 100
    assert pg.one("SELECT count(*) FROM (SELECT run_id, key FROM app.effects WHERE run_id = ANY(%s)"
                  " GROUP BY run_id, key HAVING count(*) <> 1) x", runs) == 0
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = ANY(%s)", runs) == 100 * 21
    # no event lost: every join saw all 20 inputs without timing out
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = ANY(%s) AND key = 'join'"
                  " AND result->>'inputs' = '20' AND result->>'timed_out' = 'false'", runs) == 100


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
    time.sleep(0.5)
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s AND key = 'child'", run,
                  user="alice") == "waiting"
    pg.one("SELECT flow.emit('secret', %s, '{\"from\": \"alice\"}')", key, user="alice")
    assert pg.await_run(run, "10s", user="alice")[0] == "succeeded"
    inputs = pg.one("SELECT result FROM flow.commands WHERE run_id = %s AND key = 'child'", run, user="alice")
    assert [i["payload"] for i in inputs] == [{"from": "alice"}]


def test_old_events_no_wait_refers_to_are_retired(pg):
    from conftest import unique as u
    key = u("old")
    with pg.connect() as c:
        c.execute("ALTER SYSTEM SET flow.event_retention = '1s'")
        c.execute("SELECT pg_reload_conf()")
    try:
        pg.one("SELECT flow.emit('retire_me', %s)", key)
        kept_by_wait = pg.one("SELECT count(*) FROM flow._events e WHERE EXISTS"
                              " (SELECT 1 FROM flow._waits w WHERE w.event_position = e.position)")
        pg.wait_for("SELECT count(*) = 0 FROM flow._events WHERE name = 'retire_me' AND key = %s", key, timeout=30)
        # events a retained wait refers to stay
        assert pg.one("SELECT count(*) FROM flow._events e WHERE EXISTS"
                      " (SELECT 1 FROM flow._waits w WHERE w.event_position = e.position)") >= kept_by_wait
        # nothing else may delete from the journal
        pg.one("SELECT flow.emit('retire_me_too', %s)", key)
        assert pg.sqlstate("DELETE FROM flow._events WHERE key = %s", key) == "55000"
    finally:
        with pg.connect() as c:
            c.execute("ALTER SYSTEM RESET flow.event_retention")
            c.execute("SELECT pg_reload_conf()")
