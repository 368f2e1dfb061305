"""Integration tier: tests against a real PostgreSQL 15 cluster with
shared_preload_libraries = 'flow' (tools/cluster.sh), over real connections.

Each test module gets a fresh cluster (module-scoped fixture `pg`), so crash
and restart tests cannot disturb others. Tests assert outcomes: states,
counts, results, SQLSTATEs.
"""
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
