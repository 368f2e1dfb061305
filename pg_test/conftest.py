"""Integration tier: tests against a real PostgreSQL 15 cluster with
shared_preload_libraries = 'flow' (tools/cluster.sh), over real connections.

Each test module gets a fresh cluster (module-scoped fixture `pg`), so crash
and restart tests cannot disturb others. Tests assert outcomes: states,
counts, results, SQLSTATEs.
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


class Cluster:
    def __init__(self, directory="/tmp/flow-it", port=5499):
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
        deadline = time.time() + timeout
        while True:
            try:
                with self.connect() as c:
                    c.execute("SELECT 1")
                    return
            except psycopg.OperationalError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

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
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.one(query, *args, user=user):
                return True
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for: {query}")

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

    @contextlib.contextmanager
    def engine_paused(self, settle=0.5):
        """flow.enabled = off for the block (the workers claim, recover and
        conclude nothing), after `settle` seconds for them to notice."""
        self.all("ALTER SYSTEM SET flow.enabled = off")
        self.all("SELECT pg_reload_conf()")
        try:
            time.sleep(settle)
            yield
        finally:
            self.all("ALTER SYSTEM RESET flow.enabled")
            self.all("SELECT pg_reload_conf()")


def fresh_cluster(*conf_lines):
    cluster = Cluster()
    cluster.start(*conf_lines)
    cluster.wait_ready()
    return cluster


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2")
    yield cluster
    cluster.stop()


def unique(prefix="t"):
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def external_workers_cluster():
    """A fresh cluster (one worker) for external workers' tests: roles alice
    and bob, and `in_db_child`, an in-database definition whose handler
    records what it saw (app.effects) and returns its inputs."""
    cluster = fresh_cluster("flow.workers = 1")
    with cluster.connect() as c:
        c.execute("""
            DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;
            EXCEPTION WHEN duplicate_object THEN NULL; END $$;
            CREATE SCHEMA app;
            CREATE TABLE app.effects (run_id uuid, key text);
            CREATE FUNCTION app.after_external(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.effects VALUES (ctx.run_id, ctx.command_key);
                RETURN jsonb_build_object('inputs', ctx.inputs);
            END $$;
            SELECT flow.define('in_db_child', 'app.after_external'::regproc);
        """)
    return cluster


def define_external(pg, prefix, user="postgres", **kw):
    """A new external definition (handler NULL) owned by `user`; kw: flow.define's named arguments, as SQL."""
    name = unique(prefix)
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    pg.one(f"SELECT flow.define('{name}', NULL{params})", user=user)
    return name


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
