"""Backups: a pg_dump taken mid-workflow, restored with pg_restore (and the
plain format with psql) into a fresh database, keeps every definition, queue,
run, command, attempt, wait and event, and the restored work completes with
the same results and no duplicated effect once the workers serve it."""
import subprocess
from pathlib import Path

import pytest

from conftest import PGBIN, Cluster, priorities_noted

SOURCE_COUNTS = """
SELECT jsonb_build_object(
  'definitions', (SELECT jsonb_agg(jsonb_build_array(name, version, handler::text, owner::text, queue,
                                                     max_attempts, backoff::text) ORDER BY name, version)
                  FROM flow._definitions),
  'queues', (SELECT jsonb_agg(jsonb_build_array(name, concurrency, paused, rate, per::text, group_concurrency,
                                                priorities, grouped_priorities)
                              ORDER BY name) FROM flow._queues),
  'schedules', (SELECT jsonb_agg(jsonb_build_array(owner::text, name, cron, timezone, definition, args, paused,
                                                   next_tick) ORDER BY owner::text, name) FROM flow._schedules),
  'runs', (SELECT jsonb_agg(jsonb_build_array(id, key, owner::text, status, result) ORDER BY id) FROM flow._run_rows),
  'commands', (SELECT jsonb_agg(jsonb_build_array(id, run_id, key, status, attempts, next_run_at, priority, group_key)
                                ORDER BY id)
               FROM flow._commands),
  'attempts', (SELECT count(*) FROM flow._attempts),
  'waits', (SELECT jsonb_agg(jsonb_build_array(command_id, name, key, event_position) ORDER BY command_id, name, key)
            FROM flow._waits),
  'events', (SELECT jsonb_agg(jsonb_build_array(position, name, key, payload, owner::text) ORDER BY position)
             FROM flow._events),
  'effects', (SELECT count(*) FROM app.effects))
"""


def sh(*args, **kw):
    done = subprocess.run(["sudo", "-u", "postgres", *args], capture_output=True, text=True, **kw)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def pg():
    cluster = Cluster()
    cluster.start("flow.workers = 2")
    cluster.wait_ready()
    yield cluster
    cluster.stop()


def connect_to(cluster, dbname, user="postgres"):
    import psycopg
    return psycopg.connect(f"host={cluster.dir} port={cluster.port} user={user} dbname={dbname}", autocommit=True)


def test_a_dump_taken_mid_workflow_restores_and_completes(pg):
    with pg.connect() as c:
        c.execute("""
            DO $$ BEGIN CREATE ROLE dump_alice LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
            CREATE SCHEMA app;
            GRANT USAGE ON SCHEMA app TO dump_alice;
            CREATE TABLE app.effects (key text, attempt int);
            GRANT INSERT, SELECT ON app.effects TO dump_alice;

            -- fan-out: the root spawns three parts, each waiting on its own 'go' event,
            -- and a join waiting on every part's 'part_done'
            CREATE FUNCTION app.root(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            DECLARE waits flow.wait_spec[] := '{}';
            BEGIN
                FOR i IN 1..3 LOOP
                    PERFORM flow.spawn('part', jsonb_build_object('i', i), key => 'part-' || i,
                                       waits => array[flow.wait('go', 'part-' || i)], within => '10 minutes');
                    waits := waits || flow.wait('part_done', 'part-' || i);
                END LOOP;
                PERFORM flow.spawn('join', '{}', key => 'join', waits => waits, within => '10 minutes');
                RETURN '{"spawned": 3}';
            END $$;
            CREATE FUNCTION app.part(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects VALUES (ctx.command_key, ctx.attempt);
                PERFORM flow.emit('part_done', ctx.command_key, jsonb_build_object('i', args->'i'));
                RETURN args;
            END $$;
            CREATE FUNCTION app.join_(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects VALUES ('join', ctx.attempt);
                RETURN jsonb_build_object('inputs', jsonb_array_length(ctx.inputs), 'timed_out', ctx.wait_timed_out);
            END $$;
            -- fails its first attempt, so a retry is scheduled at dump time
            CREATE FUNCTION app.flaky(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                IF ctx.attempt = 1 THEN RAISE EXCEPTION 'first attempt fails'; END IF;
                INSERT INTO app.effects VALUES ('flaky', ctx.attempt);
                RETURN '{"ok": true}';
            END $$;
            -- still running when the dump is taken
            CREATE FUNCTION app.slow(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                IF ctx.attempt = 1 THEN PERFORM pg_sleep(30); END IF;
                INSERT INTO app.effects VALUES ('slow', ctx.attempt);
                RETURN '{"slept": true}';
            END $$;
            CREATE FUNCTION app.held(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects VALUES ('held-' || (args->>'i'), 1);
                RETURN args;
            END $$;
            GRANT EXECUTE ON FUNCTION app.held(jsonb) TO dump_alice;
        """)
        for name, fn in [("root", "app.root"), ("part", "app.part"), ("join", "app.join_")]:
            c.execute(f"SELECT flow.define('{name}', '{fn}(jsonb, flow.context)'::regprocedure)")
        c.execute("SELECT flow.define('flaky', 'app.flaky(jsonb, flow.context)'::regprocedure, backoff => '4 s', backoff_max => '4 s')")
        c.execute("SELECT flow.define('slow', 'app.slow(jsonb, flow.context)'::regprocedure, max_attempts => 3)")
        wf = c.execute("SELECT flow.enqueue('root', '{}', key => 'wf')").fetchone()[0]
        done = c.execute("SELECT flow.enqueue('flaky', '{}', key => 'done-before')").fetchone()[0]
    # a role's own definition on its own paused queue
    with pg.connect("dump_alice") as a:
        a.execute("SELECT flow.define('held', 'app.held'::regproc, queue => 'held_q')")
        a.execute("SELECT flow.set_queue('held_q', paused => true, rate => 100, group_concurrency => 1)")
        held = [a.execute("SELECT flow.enqueue('held', jsonb_build_object('i', %s), priority => %s, group_key => %s)",
                          (i, 5 - i, f"g{i % 2}")).fetchone()[0]
                for i in range(5)]
        # and a schedule of hers (yearly: it fires nothing here)
        a.execute("SELECT flow.schedule('report', '0 0 1 1 *', 'held', '{\"i\": 9}', timezone => 'Europe/Paris')")
    with pg.connect() as c:
        # the workflow reaches its waits; part-1 gets its event and finishes
        pg.wait_for("SELECT count(*) = 4 FROM flow._commands WHERE status = 'waiting'")
        c.execute("SELECT flow.emit('go', 'part-1')")
        pg.wait_for("SELECT status = 'succeeded' FROM flow._commands WHERE key = 'part-1'")
        assert pg.await_run(done)[0] == "succeeded"
        flaky = c.execute("SELECT flow.enqueue('flaky', '{}', key => 'retrying')").fetchone()[0]
        pg.wait_for("SELECT attempts = 1 AND status = 'pending' FROM flow._commands WHERE run_id = %s", flaky)
        slow = c.execute("SELECT flow.enqueue('slow', '{}')").fetchone()[0]
        pg.wait_for("SELECT status = 'running' FROM flow.commands WHERE run_id = %s", slow)

        priorities_noted(pg)
        # both formats, taken while `slow` runs and a retry of `flaky` is scheduled,
        # from one exported snapshot that the expected contents are read in too
        dumps = Path(pg.dir) / "dumps"
        sh("mkdir", "-p", str(dumps))
        custom, plain = dumps / "flow.dump", dumps / "flow.sql"
        with pg.connect(autocommit=False) as snap:
            snap.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            snapshot = snap.execute("SELECT pg_export_snapshot()").fetchone()[0]
            before = snap.execute(SOURCE_COUNTS).fetchone()[0]
            for fmt, path in (("-Fc", custom), ("-Fp", plain)):
                sh(f"{PGBIN}/pg_dump", "-h", pg.dir, "-p", str(pg.port), fmt, f"--snapshot={snapshot}",
                   "-f", str(path), "postgres")
        assert before["commands"] and before["waits"] and before["events"] and before["schedules"]
        assert any(q[6] != [0] for q in before["queues"]) and any(q[7] for q in before["queues"])
        c.execute("CREATE DATABASE restored")
        c.execute("CREATE DATABASE restored_plain")
    assert len(before["runs"]) == 9

    # restore while the workers serve another database: nothing runs there
    sh(f"{PGBIN}/pg_restore", "-h", pg.dir, "-p", str(pg.port), "--single-transaction", "-d", "restored", str(custom))
    sh(f"{PGBIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", pg.dir, "-p", str(pg.port), "-d", "restored_plain",
       "-f", str(plain))
    for db in ("restored", "restored_plain"):
        with connect_to(pg, db) as r:
            after = r.execute(SOURCE_COUNTS).fetchone()[0]
        assert after == before, db

    # the workers now serve the restored database
    pg.run("conf", "flow.database_name = 'restored'")
    pg.restart()
    pg.wait_ready()
    with connect_to(pg, "restored") as r:
        r.execute("SELECT flow.emit('go', 'part-2')")
        r.execute("SELECT flow.emit('go', 'part-3')")
        status, result, _ = r.execute("SELECT status, result, error FROM flow.await(%s, '60 s')", (wf,)).fetchone()
        assert (status, result) == ("succeeded", {"spawned": 3})
        join = r.execute("SELECT result FROM flow._commands WHERE run_id = %s AND key = 'join'", (wf,)).fetchone()[0]
        assert join == {"inputs": 3, "timed_out": False}
        # the retry that was scheduled runs once, as attempt 2
        assert r.execute("SELECT status FROM flow.await(%s, '60 s')", (flaky,)).fetchone()[0] == "succeeded"
        assert r.execute("SELECT attempts FROM flow._commands WHERE run_id = %s", (flaky,)).fetchone()[0] == 2
        # the command running at dump time belonged to no live worker: interrupted, then retried
        assert r.execute("SELECT status FROM flow.await(%s, '60 s')", (slow,)).fetchone()[0] == "succeeded"
        outcomes = r.execute("SELECT array_agg(a.outcome ORDER BY a.attempt) FROM flow.attempts a "
                             "WHERE a.run_id = %s", (slow,)).fetchone()[0]
        assert outcomes == ["interrupted", "succeeded"]
    # the paused queue is still paused and still dump_alice's to resume
    with connect_to(pg, "restored", "dump_alice") as a:
        assert a.execute("SELECT paused FROM flow.queues WHERE name = 'held_q'").fetchone()[0] is True
        assert a.execute("SELECT count(*) FROM flow.runs WHERE status = 'running'").fetchone()[0] == 5
        assert a.execute("SELECT (rate, group_concurrency)::text FROM flow.queues WHERE name = 'held_q'").fetchone()[0] \
            == "(100,1)"
        assert a.execute("SELECT (cron, timezone, owner::text) FROM flow.schedules WHERE name = 'report'").fetchone()[0] \
            == ("0 0 1 1 *", "Europe/Paris", "dump_alice")
        a.execute("SELECT flow.set_queue('held_q', paused => false)")
        for run in held:
            assert a.execute("SELECT status FROM flow.await(%s, '60 s')", (run,)).fetchone()[0] == "succeeded"
    with connect_to(pg, "restored") as r:
        effects = dict(r.execute("SELECT key, count(*) FROM app.effects GROUP BY key").fetchall())
        assert effects == {"part-1": 1, "part-2": 1, "part-3": 1, "join": 1, "flaky": 2, "slow": 1,
                           **{f"held-{i}": 1 for i in range(5)}}
        # nothing ran in the plain-format copy: no worker serves it
        with connect_to(pg, "restored_plain") as p:
            assert p.execute("SELECT count(*) FROM flow._run_rows WHERE status = 'running'").fetchone()[0] == 8
