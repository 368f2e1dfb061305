"""Re-drive (flow.retry): the failed and cancelled commands of a failed or
cancelled run run again with a fresh attempt budget, their history kept
(sql/workflows.sql, flow._retry)."""
import pytest

from conftest import app_cluster, retire_priorities, unique

REDRIVE_APP = """
    DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;
    EXCEPTION WHEN duplicate_object THEN NULL; END $$;
    GRANT USAGE ON SCHEMA app TO PUBLIC;
    GRANT ALL ON app.effects TO PUBLIC;
    -- what is broken: a handler given {"tag": t} fails while t is listed here
    CREATE TABLE app.broken (tag text PRIMARY KEY);
    GRANT ALL ON app.broken TO PUBLIC;

    CREATE FUNCTION app.step(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        IF EXISTS (SELECT 1 FROM app.broken WHERE tag = args->>'tag') THEN
            RAISE EXCEPTION 'step % is broken', args->>'tag';
        END IF;
        INSERT INTO app.effects (run_id, key, attempt, tag) VALUES (ctx.run_id, ctx.command_key, ctx.attempt, args->>'tag');
        RETURN jsonb_build_object('attempt', ctx.attempt);
    END $$;

    -- a root that spawns a child per tag in args.tags, and one that waits for ('go', args.key)
    CREATE FUNCTION app.parent(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE t text;
    BEGIN
        FOR t IN SELECT jsonb_array_elements_text(args->'tags') LOOP
            PERFORM flow.spawn('step', jsonb_build_object('tag', t), key => t);
        END LOOP;
        IF args ? 'key' THEN
            PERFORM flow.spawn('step', jsonb_build_object('tag', 'waiter'), key => 'waiter',
                               waits => ARRAY[flow.wait('go', args->>'key')], within => '1 hour');
        END IF;
        RETURN jsonb_build_object('spawned', jsonb_array_length(args->'tags'));
    END $$;
    SELECT flow.define('step', 'app.step'::regproc, max_attempts => 2, backoff => '10 ms', backoff_max => '10 ms');
    SELECT flow.define('parent', 'app.parent'::regproc, max_attempts => 2, backoff => '10 ms');
"""


@pytest.fixture(scope="module")
def pg():
    cluster = app_cluster(REDRIVE_APP)
    yield cluster
    cluster.stop()


def break_(pg, *tags):
    pg.all("INSERT INTO app.broken SELECT unnest(%s::text[])", list(tags))


def fix(pg, *tags):
    pg.all("DELETE FROM app.broken WHERE tag = ANY (%s)", list(tags))


def step_attempts(pg, run, key):
    return pg.all("SELECT a.attempt, a.outcome FROM flow.attempts a JOIN flow.commands c ON c.id = a.command_id"
                  " WHERE a.run_id = %s AND c.key = %s ORDER BY a.attempt", run, key)


def test_a_failed_child_of_a_workflow_runs_again_and_the_run_succeeds(pg):
    bad = unique("bad")
    break_(pg, bad)
    run = pg.one("SELECT flow.enqueue('parent', jsonb_build_object('tags', jsonb_build_array('ok1', %s::text, 'ok2')))",
                 bad)
    status, _, error = pg.await_run(run)
    assert status == "failed" and error["command_key"] == bad and error["stop_reason"] == "attempt_limit"
    fix(pg, bad)
    assert pg.one("SELECT flow.retry(%s)", run) is True
    status, result, error = pg.await_run(run)
    # the root's result, unchanged: the root itself had succeeded and is not run again
    assert (status, result, error) == ("succeeded", {"spawned": 3}, None)
    # the failed child: its two charged attempts kept, then a third that succeeded
    assert step_attempts(pg, run, bad) == [(1, "retryable"), (2, "retryable"), (3, "succeeded")]
    # every step succeeded exactly once, whichever ran before the failure
    assert sorted(pg.all("SELECT key, count(*) FROM app.effects WHERE run_id = %s GROUP BY 1", run)) == sorted([
        ("ok1", 1), ("ok2", 1), (bad, 1)])
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = %s AND key = 'root' AND attempts = 1", run) == 1


def test_a_re_drive_gives_a_fresh_attempt_budget(pg):
    bad = unique("still")
    break_(pg, bad)
    run = pg.one("SELECT flow.enqueue('step', jsonb_build_object('tag', %s::text))", bad)
    assert pg.await_run(run)[0] == "failed"
    assert pg.one("SELECT flow.retry(%s)", run) is True
    status, _, error = pg.await_run(run)
    # max_attempts (2) again, counted from the re-drive; numbers go on
    assert status == "failed" and error["stop_reason"] == "attempt_limit"
    assert [a for a, _ in step_attempts(pg, run, "root")] == [1, 2, 3, 4]
    assert pg.one("SELECT value FROM flow.stats WHERE name = 'runs_retried'") >= 1


def test_a_cancelled_run_runs_again_and_a_child_that_waited_waits_again(pg):
    key = unique("go")
    run = pg.one("SELECT flow.enqueue('parent', jsonb_build_object('tags', '[]'::jsonb, 'key', %s::text))", key)
    pg.wait_for("SELECT status = 'waiting' FROM flow.commands WHERE run_id = %s AND key = 'waiter'", run)
    assert pg.one("SELECT flow.cancel(%s)", run) is True
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s AND key = 'waiter'", run) == "cancelled"
    assert pg.one("SELECT flow.retry(%s)", run) is True
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "running"
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s AND key = 'waiter'", run) == "waiting"
    pg.one("SELECT flow.emit('go', %s)", key)
    assert pg.await_run(run)[0] == "succeeded"
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = %s AND key = 'waiter'", run) == 1


def test_only_a_failed_or_cancelled_run_is_re_driven(pg):
    run = pg.one("SELECT flow.enqueue('step', '{\"tag\": \"fine\"}')")
    assert pg.await_run(run)[0] == "succeeded"
    assert pg.one("SELECT flow.retry(%s)", run) is False
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
    # a running one
    key = unique("pending")
    running = pg.one("SELECT flow.enqueue('parent', jsonb_build_object('tags', '[]'::jsonb, 'key', %s::text))", key)
    pg.wait_for("SELECT status = 'waiting' FROM flow.commands WHERE run_id = %s AND key = 'waiter'", running)
    assert pg.one("SELECT flow.retry(%s)", running) is False
    pg.one("SELECT flow.cancel(%s)", running)


def test_bad_inputs_are_refused_and_change_nothing(pg):
    # unknown run
    assert pg.sqlstate("SELECT flow.retry(gen_random_uuid())") == "FL014"
    assert pg.sqlstate("SELECT flow.retry(NULL)") == "FL014"
    # another role's run: as unknown as a missing one (the rights of flow.cancel)
    bad = unique("theirs")
    break_(pg, bad)
    pg.one("SELECT flow.define('alice_step', 'app.step'::regproc, max_attempts => 1)", user="alice")
    run = pg.one("SELECT flow.enqueue('alice_step', jsonb_build_object('tag', %s::text))", bad, user="alice")
    assert pg.await_run(run, user="alice")[0] == "failed"
    assert pg.sqlstate("SELECT flow.retry(%s)", run, user="bob") == "FL014"
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "failed"
    # a run past its deadline cannot run again
    late = pg.one("SELECT flow.enqueue('step', jsonb_build_object('tag', %s::text), deadline => '300 ms')", bad)
    assert pg.await_run(late)[0] == "failed"
    pg.wait_for("SELECT deadline < now() FROM flow._runs WHERE id = %s", late)
    before = pg.all("SELECT status, attempts, stop_reason FROM flow._commands WHERE run_id = %s", late)
    assert pg.sqlstate("SELECT flow.retry(%s)", late) == "FL007"
    assert pg.all("SELECT status, attempts, stop_reason FROM flow._commands WHERE run_id = %s", late) == before
    # the owner may, once fixed
    fix(pg, bad)
    assert pg.one("SELECT flow.retry(%s)", run, user="alice") is True
    assert pg.await_run(run, user="alice")[0] == "succeeded"


def test_a_re_drive_notes_a_priority_forgotten_since_and_refuses_a_dropped_queue(pg):
    """A failed command's priority may have been forgotten since it ended (no
    unfinished command had it, flow._retire_priorities): its re-drive notes
    it again, and the command runs. One whose queue was dropped since is
    refused (42704), and nothing changes: in no queue, it would never run."""
    queue, bad = unique("q"), unique("prio")
    name = unique("step")
    pg.one(f"SELECT flow.define('{name}', 'app.step'::regproc, queue => '{queue}', max_attempts => 1)")
    break_(pg, bad)
    run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text), priority => 12)", name, bad)
    assert pg.await_run(run)[0] == "failed"
    pg.wait_for("SELECT count(*) = 0 FROM flow._priority_notes")
    retire_priorities(pg)
    assert pg.one("SELECT priorities FROM flow._queues WHERE name = %s", queue) == [0]
    fix(pg, bad)
    assert pg.one("SELECT flow.retry(%s)", run) is True
    assert pg.await_run(run)[0] == "succeeded"
    # the same, once its queue is gone
    break_(pg, bad)
    run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text))", name, bad)
    assert pg.await_run(run)[0] == "failed"
    pg.one(f"SELECT flow.define('{name}', 'app.step'::regproc, queue => 'default', max_attempts => 1)")
    assert pg.one("SELECT flow.drop_queue(%s)", queue) is True
    fix(pg, bad)
    before = pg.all("SELECT status, attempts, attempt_base, finished_at FROM flow._commands WHERE run_id = %s", run)
    assert pg.sqlstate("SELECT flow.retry(%s)", run) == "42704"
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "failed"
    assert pg.all("SELECT status, attempts, attempt_base, finished_at FROM flow._commands WHERE run_id = %s",
                  run) == before


def test_a_re_drive_into_a_queue_another_role_made_again_is_refused(pg):
    """A queue dropped and made again by another role is that role's: the
    run's owner may not put its commands there by re-driving (FL011)."""
    queue, bad, name = unique("q"), unique("theirs"), unique("alice_step")
    break_(pg, bad)
    pg.one(f"SELECT flow.define('{name}', 'app.step'::regproc, queue => '{queue}', max_attempts => 1)", user="alice")
    run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('tag', %s::text))", name, bad, user="alice")
    assert pg.await_run(run, user="alice")[0] == "failed"
    pg.one(f"SELECT flow.define('{name}', 'app.step'::regproc, max_attempts => 1)", user="alice")
    assert pg.one("SELECT flow.drop_queue(%s)", queue, user="alice") is True
    pg.one("SELECT flow.set_queue(%s, paused => true)", queue, user="bob")
    fix(pg, bad)
    assert pg.sqlstate("SELECT flow.retry(%s)", run, user="alice") == "FL011"
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "failed"
    assert pg.one("SELECT count(*) FROM flow._commands WHERE queue = %s AND finished_at IS NULL", queue) == 0
