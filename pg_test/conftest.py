"""Integration tier: tests against a real PostgreSQL 15 cluster with
shared_preload_libraries = 'flow' (tools/cluster.sh), over real connections.

Each test module gets a fresh cluster (module-scoped fixture `pg`, which a
module overrides to choose its settings and the objects its tests need:
`app_cluster` and the object sets below), so crash and restart tests cannot
disturb others. Tests assert outcomes: states, counts, results, SQLSTATEs.

The files, by subject: test_api (the public SQL API, bad inputs and errors),
test_fuzz (the API under adversarial arguments), test_golden (the API's SQL
golden file, golden/), test_engine (claim, execute, settle, retry, wake-up,
fairness), test_scale (plans at size), test_cancel, test_isolation (claim vs
cancel, isolation/), test_workflows (spawn, waits, events, sagas),
test_external (external workers, leased and held claims), test_security
(hostile roles), test_crash (crash and fault tests), test_retention,
test_upgrade, test_backup.

Waiting: `pg.wait_for(query)` (or `poll(predicate)`) waits for a condition;
a fixed `time.sleep` is left only where the passage of time is itself what a
test checks ("nothing happened within 2 s"), with a comment saying so.
"""
import contextlib
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = str(ROOT / "tools" / "cluster.sh")
PGBIN = "/usr/lib/postgresql/15/bin"


def poll(predicate, timeout=30.0, interval=0.05, what="a condition"):
    """Call `predicate` until it returns something true, and return that."""
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(interval)   # (the polling interval)


class Cluster:
    def __init__(self, directory=None, port=None):
        # (FLOW_TEST_PGDIR / FLOW_TEST_PGPORT: another cluster than the default one, read at each call)
        if directory is None:
            directory = os.environ.get("FLOW_TEST_PGDIR", "/tmp/flow-it")
        if port is None:
            port = int(os.environ.get("FLOW_TEST_PGPORT", "5499"))
        self.dir = directory
        self.port = port
        self.env = dict(os.environ, FLOW_PGDIR=directory, FLOW_PGPORT=str(port))

    def run(self, *args, **env):
        subprocess.run([CLUSTER, *args], check=True, env={**self.env, **env})

    def start(self, *conf_lines, **env):
        self.run("start", *conf_lines, **env)

    def stop(self):
        self.run("stop")

    def restart(self):
        self.run("restart")

    def pg_ctl(self, *args, timeout=120):
        return subprocess.run(["sudo", "-u", "postgres", f"{PGBIN}/pg_ctl", "-D", f"{self.dir}/pgdata",
                               "-l", f"{self.dir}/pg.log", *args], check=True, timeout=timeout,
                              capture_output=True)

    def conninfo(self, user="postgres"):
        return f"host={self.dir} port={self.port} user={user} dbname=postgres"

    def connect(self, user="postgres", autocommit=True):
        return psycopg.connect(self.conninfo(user), autocommit=autocommit)

    def wait_ready(self, timeout=60):
        def ready():
            try:
                with self.connect() as c:
                    c.execute("SELECT 1")
                    return True
            except psycopg.OperationalError:
                return False
        poll(ready, timeout, 0.2, "the server to accept connections")

    # -- helpers used by every test module
    def all(self, query, *args, user="postgres"):
        with self.connect(user) as c:
            cur = c.execute(query, args or None)
            return cur.fetchall() if cur.description else []

    def one(self, query, *args, user="postgres"):
        rows = self.all(query, *args, user=user)
        return rows[0][0] if rows else None

    def sqlstate(self, query, *args, user="postgres"):
        """Run a statement that must fail; return its SQLSTATE."""
        with self.connect(user) as c:
            with pytest.raises(psycopg.Error) as caught:
                c.execute(query, args or None)
            return caught.value.sqlstate

    def await_run(self, run_id, timeout="30s", user="postgres"):
        return self.all("SELECT status, result, error FROM flow.await(%s, %s::interval)", run_id, timeout,
                        user=user)[0]

    def wait_for(self, query, *args, timeout=30.0, user="postgres"):
        """Poll until `query` returns a true first value."""
        return poll(lambda: self.one(query, *args, user=user), timeout, what=query)

    def waiting_call(self, sql, args, like, user="postgres"):
        """Run `sql` in another session and wait until it waits for a lock (a
        backend whose query is LIKE `like`): what it read before that lock, it
        read as it was. Returns a function that gives its rows, or the
        SQLSTATE of its error, once whoever holds the lock has ended."""
        out = {}

        def call():
            with self.connect(user) as c:
                try:
                    out["rows"] = c.execute(sql, args).fetchall()
                except psycopg.Error as e:
                    out["rows"] = e.sqlstate

        thread = threading.Thread(target=call)
        thread.start()
        self.wait_for("SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                      " AND query LIKE %s AND pid <> pg_backend_pid()", like)

        def result():
            thread.join(30)
            assert not thread.is_alive(), f"still waiting: {sql}"
            return out["rows"]
        return result

    def log(self):
        return Path(f"{self.dir}/pg.log").read_text(errors="replace")

    def worker_pids(self):
        return [r[0] for r in self.all("SELECT pid FROM pg_stat_activity WHERE backend_type = 'flow worker'")]

    def wait_handler_sleeping(self, run, timeout=30.0):
        """Wait until a worker runs a handler of `run` and that handler is in
        pg_sleep (its attempt has begun, not just its lease)."""
        self.wait_for("SELECT EXISTS (SELECT 1 FROM flow.workers w JOIN pg_stat_activity a ON a.pid = w.pid"
                      " WHERE w.command_id IN (SELECT id FROM flow.commands WHERE run_id = %s)"
                      " AND a.wait_event = 'PgSleep')", run, timeout=timeout)

    def wait_workers_asleep(self, count, timeout=30.0):
        """Wait until `count` workers wait on their latches (idle, asleep)."""
        self.wait_for("SELECT count(*) = %s FROM pg_stat_activity WHERE backend_type = 'flow worker'"
                      " AND wait_event_type = 'Extension' AND wait_event = 'Extension'", count, timeout=timeout)

    def wait_crash_restart(self, before, timeout=60.0):
        """After a SIGKILL of a backend: the postmaster restarts every process.
        Wait until the server accepts connections again and the flow workers
        are new ones (none of `before`, the worker pids before the kill)."""
        def restarted():
            try:
                pids = self.worker_pids()
            except psycopg.OperationalError:
                return False
            return bool(pids) and not set(pids) & set(before)
        poll(restarted, timeout, 0.1, "the cluster's restart after a crash")

    def configure(self, setting, value=None, settle=0.0):
        """ALTER SYSTEM SET `setting` (RESET when value is None) and reload,
        then `settle` seconds for the workers to apply it. (A worker applies a
        reload at its next turn, and nothing outside the worker shows when it
        did: this is the one place a fixed pause stands for a condition.)"""
        if value is None:
            self.all(f"ALTER SYSTEM RESET {setting}")
        else:
            self.all(f"ALTER SYSTEM SET {setting} = '{value}'")
        self.all("SELECT pg_reload_conf()")
        if settle:
            time.sleep(settle)

    @contextlib.contextmanager
    def engine_paused(self, settle=0.5):
        """flow.enabled = off for the block (the workers claim, recover and
        conclude nothing), after `settle` seconds for them to notice."""
        self.configure("flow.enabled", "off", settle=settle)
        try:
            yield
        finally:
            self.configure("flow.enabled")


def fresh_cluster(*conf_lines):
    cluster = Cluster()
    cluster.start(*conf_lines)
    cluster.wait_ready()
    return cluster


@contextlib.contextmanager
def own_cluster(directory, port, *conf_lines):
    """A cluster of a test's own, beside its module's, stopped after it."""
    cluster = Cluster(directory, port)
    cluster.start(*conf_lines)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def unique(prefix="t"):
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------- the objects tests use
# Each set is the SQL a module's cluster runs once (app_cluster). Tests of
# several subjects share one schema, app, and one table of the effects their
# handlers write, app.effects, with the columns each set's handlers use
# (some insert by position: run_id, key, attempt come first).

EFFECTS = """
    CREATE SCHEMA IF NOT EXISTS app;
    CREATE TABLE IF NOT EXISTS app.effects (run_id uuid, key text, attempt int, run_key text, tag text, q text,
                                            at timestamptz DEFAULT clock_timestamp(), who text DEFAULT current_user);
"""

# The engine's handlers: hello, always_fails, decides (what its args say) and record.
ENGINE_APP = """
    GRANT USAGE ON SCHEMA app TO PUBLIC;
    GRANT ALL ON app.effects TO PUBLIC;

    CREATE FUNCTION app.hello(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        RETURN jsonb_build_object('hello', args->>'who', 'user', current_user,
                                  'search_path', current_setting('search_path'));
    END $$;

    CREATE FUNCTION app.always_fails(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO app.effects (run_key, attempt) VALUES (args->>'tag', ctx.attempt);
        RETURN (1 / 0)::text::jsonb;
    END $$;

    CREATE FUNCTION app.decides(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO app.effects (run_key, attempt) VALUES (args->>'tag', ctx.attempt);
        CASE args->>'do'
            WHEN 'fail' THEN PERFORM flow.fail('card declined');
            WHEN 'retry_after' THEN
                IF ctx.attempt = 1 THEN PERFORM flow.retry_after('400 ms', 'rate limited'); END IF;
            WHEN 'bad_retry' THEN PERFORM flow.retry_after('-1 s');
            WHEN 'sleep' THEN PERFORM pg_sleep((args->>'seconds')::float);
            WHEN 'sleep_then_raise' THEN
                IF ctx.attempt = 1 THEN
                    PERFORM pg_sleep((args->>'seconds')::float);
                    RAISE EXCEPTION 'the first attempt fails';
                END IF;
            WHEN 'sleep_first' THEN
                IF ctx.attempt = 1 THEN PERFORM pg_sleep((args->>'seconds')::float); END IF;
            WHEN 'big' THEN RETURN jsonb_build_object('big', repeat('x', 300000));
            WHEN 'die' THEN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5);
            WHEN 'catch_fail' THEN
                BEGIN PERFORM flow.fail('caught'); EXCEPTION WHEN OTHERS THEN NULL; END;
                RAISE EXCEPTION 'plain error';
            ELSE NULL;
        END CASE;
        RETURN jsonb_build_object('attempt', ctx.attempt, 'deadline_set', ctx.deadline IS NOT NULL);
    END $$;

    CREATE FUNCTION app.record(args jsonb) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO app.effects (run_key, q, at) VALUES (args->>'tag', args->>'q', clock_timestamp());
        IF args ? 'sleep' THEN PERFORM pg_sleep((args->>'sleep')::float); END IF;
        INSERT INTO app.effects (run_key, q, at) VALUES (args->>'tag', 'end:' || (args->>'q'), clock_timestamp());
    END $$;
"""

# app.act: the rules 0.1.0 got wrong (sagas, cancel, waits, decisions,
# budgets), each one an action its args name; with ACT, define's handler.
ACT = "app.act(jsonb, flow.context)"
ACT_APP = """
    CREATE FUNCTION app.act(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO app.effects (tag) VALUES (coalesce(args->>'tag', ctx.command_key));
        CASE args->>'do'
            WHEN 'compensate' THEN
                INSERT INTO app.effects (tag) VALUES ('refund:' || (args->>'tag'));
                PERFORM flow.emit('refunded', args->>'tag');
                PERFORM flow.fail('could not ship', keep_writes => true);
                RETURN '{"returned": "after fail"}';
            WHEN 'sleep' THEN PERFORM pg_sleep((args->>'seconds')::float);
            WHEN 'sleep_first' THEN
                IF NOT EXISTS (SELECT 1 FROM app.effects WHERE tag = 'slept:' || (args->>'tag')) THEN
                    INSERT INTO app.effects (tag) VALUES ('slept:' || (args->>'tag'));
                    PERFORM pg_sleep((args->>'seconds')::float);
                END IF;
            WHEN 'cancel_self' THEN PERFORM flow.cancel(ctx.run_id);
            WHEN 'stubborn' THEN
                LOOP BEGIN PERFORM pg_sleep(10); EXCEPTION WHEN query_canceled THEN NULL; END; END LOOP;
            WHEN 'swallow_timeout' THEN
                BEGIN PERFORM pg_sleep(5); EXCEPTION WHEN query_canceled THEN NULL; END;
            WHEN 'bad_spawn' THEN
                BEGIN PERFORM flow.spawn('no_such_definition', '{}', key => 'x');
                EXCEPTION WHEN OTHERS THEN NULL; END;
            WHEN 'spawn_no_waits' THEN
                PERFORM flow.spawn(args->>'child', '{}', key => 'child', waits => NULL);
            WHEN 'spawn_waiting' THEN
                PERFORM flow.spawn(args->>'child', '{}', key => 'child',
                                   waits => array[flow.wait('never', ctx.run_id::text)]);
            WHEN 'spawn_for_event' THEN
                PERFORM flow.spawn(args->>'child', jsonb_build_object('do', 'fail_first'), key => 'child',
                                   waits => array[flow.wait('go', args->>'tag')], within => '1 minute');
            WHEN 'fail_first' THEN
                IF ctx.attempt = 1 THEN RAISE EXCEPTION 'first attempt fails'; END IF;
            ELSE NULL;
        END CASE;
        RETURN jsonb_build_object('attempt', ctx.attempt);
    END $$;
"""

# Workflows: fan-out/fan-in, waits on events, re-spawns, a doomed parent;
# each defined under its own name ('fan_root', 'leaf', ...).
WORKFLOW_APP = """
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

    SELECT flow.define(d.name, d.handler::regproc, max_attempts => 20, backoff => '10 ms', backoff_max => '100 ms')
    FROM (VALUES ('fan_root', 'app.fan_root'), ('fan_part', 'app.fan_part'), ('fan_join', 'app.fan_join'),
                 ('wait_root', 'app.wait_root'), ('wait_child', 'app.wait_child'), ('respawn', 'app.respawn'),
                 ('leaf', 'app.leaf'), ('doomed', 'app.doomed')) d (name, handler);
"""

# External workers: roles alice and bob, and `in_db_child`, an in-database
# definition whose handler records what it saw (app.effects) and returns its inputs.
EXTERNAL_APP = """
    DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;
    EXCEPTION WHEN duplicate_object THEN NULL; END $$;
    CREATE FUNCTION app.after_external(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO app.effects VALUES (ctx.run_id, ctx.command_key);
        RETURN jsonb_build_object('inputs', ctx.inputs);
    END $$;
    SELECT flow.define('in_db_child', 'app.after_external'::regproc);
"""


def app_cluster(*sets, conf=("flow.workers = 2",)):
    """A fresh cluster (postgresql.conf lines `conf`) with these object sets."""
    cluster = fresh_cluster(*conf)
    with cluster.connect() as c:
        c.execute(EFFECTS)
        for sql in sets:
            c.execute(sql)
    return cluster


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def app(pg):
    """The module's cluster, under the name the engine's tests use."""
    return pg


# ---------------------------------------------------------------- in-database definitions and runs

def define(pg, handler, user="postgres", **kw):
    """A new definition of `handler` (a function name, or a signature with its
    argument types) owned by `user`; kw: flow.define's named arguments, as SQL."""
    name = unique("d")
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    cast = "regprocedure" if "(" in handler else "regproc"
    pg.one(f"SELECT flow.define('{name}', '{handler}'::{cast}{params})", user=user)
    return name


def enqueue(pg, name, args="{}", user="postgres", **kw):
    """flow.enqueue of `name` with `args`; kw: its other named arguments, as SQL."""
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    return pg.one(f"SELECT flow.enqueue('{name}', '{args}'{params})", user=user)


def attempts(pg, run):
    """A run's attempts: (attempt, outcome, error_code, error_message, started_at)."""
    return pg.all("SELECT attempt, outcome, error_code, error_message, started_at FROM flow.attempts"
                  " WHERE run_id = %s ORDER BY attempt", run)


def command(pg, run):
    """A run's root command as flow.commands shows it."""
    return pg.all("SELECT status, attempts, stop_reason, last_error_code, last_error_message"
                  " FROM flow.commands WHERE run_id = %s AND key = 'root'", run)[0]


def root(pg, run):
    """A run's root command as its table has it."""
    return pg.all("SELECT status::text, attempts, stop_reason, last_error_code FROM flow._commands"
                  " WHERE run_id = %s AND key = 'root'", run)[0]


def commands(pg, run):
    """A run's commands: {key: status}."""
    return dict(pg.all("SELECT key, status FROM flow.commands WHERE run_id = %s", run))


def effects(pg, tag):
    return pg.one("SELECT count(*) FROM app.effects WHERE tag = %s", tag)


def seen_fast(pg, name):
    """Let the workers see the handler of `name` finish fast (100 runs of
    '{}' args): from then on its commands are held (see flow._claim)."""
    for _ in range(5):
        for run in pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[20]))"):
            assert pg.await_run(run, "10s")[0] == "succeeded"


def priorities_noted(pg):
    """Wait until the priorities (and groups) that enqueues noted are in their
    queues' rows: the maintenance worker adds them a moment after their commit
    (flow._fold_priority_notes), and claims read those rows."""
    pg.wait_for("SELECT count(*) = 0 FROM flow._priority_notes")


def retire_priorities(pg, conn=None):
    """A pass of what the maintenance worker does once a minute: forget the
    priorities no unfinished command of a queue has (flow._retire_priorities,
    queue by queue); how many queues changed (of the whole cluster).
    `conn`: run it there (its own transactions) instead of new connections."""
    changed, after = 0, ""
    while True:
        sql = "SELECT queue, changed FROM flow._retire_priorities(%s)"
        queue, did = conn.execute(sql, (after,)).fetchone() if conn else pg.all(sql, after)[0]
        if queue is None:
            return changed
        changed, after = changed + did, queue


# ---------------------------------------------------------------- external workers

QUICK = {"max_attempts": 3, "backoff": "'10 ms'", "backoff_max": "'10 ms'"}


def external(pg, user="postgres", **kw):
    """A new external definition (handler NULL) owned by `user`; kw: flow.define's named arguments, as SQL."""
    name = unique("ext")
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    pg.one(f"SELECT flow.define('{name}', NULL{params})", user=user)
    return name


def claim(conn, name, worker="w", max_=1, lease="30 s"):
    """A leased claim: (command_id, lease_token, args, attempt, context) rows."""
    return conn.execute("SELECT command_id, lease_token, args, attempt, context FROM flow.claim(%s, %s, %s, %s)",
                        ([name], worker, max_, lease)).fetchall()


def hold(conn, name, worker="w", max_=1):
    """A held claim: (command_id, lease_token, attempt, lease_expires_at) rows."""
    return conn.execute("SELECT command_id, lease_token, attempt, lease_expires_at"
                        " FROM flow.claim(%s, %s, %s, hold => true)", ([name], worker, max_)).fetchall()


def hold_when_due(conn, name, worker="w", timeout=10.0):
    """Claim held once the command is due again (after worker 0's conclusion and the backoff),
    each try in a transaction of its own (conn holds nothing else)."""
    def held():
        rows = hold(conn, name, worker)
        if not rows:
            conn.rollback()    # (due by now(): the transaction's start)
        return rows
    return poll(held, timeout, what=f"{name}: a command due again")


def hold_or_none(conn, name):
    with conn.transaction(force_rollback=True):
        return hold(conn, name)


def command_row(pg, cmd):
    """(status, attempts, lease_owner, stop_reason) of a command's row."""
    return pg.all("SELECT status::text, attempts, lease_owner, stop_reason FROM flow._commands WHERE id = %s",
                  cmd)[0]


def command_attempts(pg, cmd):
    """A command's rows in _attempts: (attempt, outcome, error_code, owner)."""
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


def spread_over_two_queues(pg, define):
    """Two external definitions (made by `define`) with due commands in two
    new queues: 10 of the first and 2 of the second in queues[0], 1 of the
    first in queues[1]. Returns (first, second, queues)."""
    first, second = define(pg), define(pg)
    queues = [unique("xq"), unique("xq")]
    for name, queue, count in ((first, queues[0], 10), (first, queues[1], 1), (second, queues[0], 2)):
        pg.one(f"SELECT cardinality(flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[{count}]),"
               f" queue => '{queue}'))")
    return first, second, queues


def assert_fan_outs_ran_once(pg, runs, parts):
    """Each of `runs` (of 'fan_root', WORKFLOW_APP) succeeded, and each of its
    `parts` children and its join ran exactly once, the join seeing every
    part's event."""
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = ANY(%s) AND status = 'succeeded'", runs) == len(runs)
    assert pg.one("SELECT count(*) FROM (SELECT run_id, key FROM app.effects WHERE run_id = ANY(%s)"
                  " GROUP BY run_id, key HAVING count(*) <> 1) x", runs) == 0
    assert pg.one("SELECT count(*) FROM app.effects WHERE run_id = ANY(%s)", runs) == len(runs) * (parts + 1)
    assert pg.one("SELECT count(*) FROM flow.commands WHERE run_id = ANY(%s) AND key = 'join'"
                  " AND result->>'inputs' = %s", runs, str(parts)) == len(runs)
