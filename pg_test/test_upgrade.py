"""Upgrades: each released version (its install script is kept in
sql/released/) is created, given runs in every state, and updated in place
with ALTER EXTENSION flow UPDATE (through every release after it). The
updated schema must equal a fresh install of this release, the workers must
wait calmly while the SQL is older than their library, and the old runs must
finish."""
import re
import time
import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest

from conftest import PGBIN, ROOT, Cluster

SHAREDIR = Path(subprocess.run(["/usr/lib/postgresql/15/bin/pg_config", "--sharedir"], check=True,
                               capture_output=True, text=True).stdout.strip())
RELEASED = sorted((ROOT / "sql" / "released").glob("flow--*.sql"))
CURRENT = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)


def flow_schema(cluster, dbname):
    """flow's objects as pg_dump writes them in binary-upgrade mode (which lists
    extension members one by one), without what differs between two databases
    with the same schema: OIDs, sequence positions, the session key."""
    out = subprocess.run(["sudo", "-u", "postgres", f"{PGBIN}/pg_dump", "-h", cluster.dir, "-p", str(cluster.port),
                          "--schema-only", "--binary-upgrade", dbname],
                         check=True, capture_output=True, text=True).stdout
    lines, keep = [], False
    for line in out.splitlines():
        if line.startswith("-- Name: "):
            keep = "; Schema: flow;" in line or "; Type: EXTENSION;" in line
            if keep:
                lines.append(line)
            continue
        if (not keep or line.startswith("--") or not line.strip() or "binary_upgrade_" in line
                or line.startswith(("\\restrict", "\\unrestrict")) or "pg_catalog.setval(" in line
                or line.startswith(("UPDATE pg_catalog.pg_class", "SET relfrozenxid", "WHERE oid = "))):
            continue
        lines.append(line)
    return "\n".join(lines)


def version_of(script):
    return script.name.removeprefix("flow--").removesuffix(".sql")


@pytest.fixture(scope="module", params=[version_of(s) for s in RELEASED])
def pg(request):
    for script in RELEASED:
        shutil.copy(script, SHAREDIR / "extension" / script.name)
    cluster = Cluster()
    cluster.start("flow.workers = 2", FLOW_CREATE="0")
    cluster.wait_ready()
    cluster.released = request.param
    yield cluster
    cluster.stop()


def test_a_released_version_updates_in_place(pg):
    assert RELEASED, "sql/released/ keeps the install script of every earlier release"
    oldest = pg.released
    roots_have_own_ids = oldest == "0.1.0"   # (0.2.0 on: a run's root has the run's id)
    with pg.connect() as c:
        # check_function_bodies = off: the old script may name C symbols this library no longer has
        c.execute("SET check_function_bodies = off")
        c.execute(f"CREATE EXTENSION flow VERSION '{oldest}'")
        c.execute("""
            CREATE SCHEMA app;
            CREATE TABLE app.effects (key text);
            CREATE FUNCTION app.work(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN INSERT INTO app.effects VALUES (args->>'k'); RETURN args; END $$;
        """)
        c.execute("SELECT flow.define('work', 'app.work'::regproc)")
        c.execute("SELECT flow.define('ext', NULL)")
        pending = [c.execute("SELECT flow.enqueue('work', jsonb_build_object('k', %s::text))", (f"p{i}",)).fetchone()[0]
                   for i in range(3)]
        later = c.execute("SELECT flow.enqueue('work', '{\"k\": \"later\"}', start_after => '2 s')").fetchone()[0]
        for _ in range(4):
            c.execute("SELECT flow.enqueue('ext', '{}')")
        claimed = c.execute("SELECT command_id, lease_token, run_id FROM flow.claim(array['ext'], 'up-1', 3, '1 hour')"
                            ).fetchall()
        assert len(claimed) == 3
        (ok_id, ok_token, ok_run), (bad_id, bad_token, bad_run), (open_id, open_token, open_run) = claimed
        # success that spawns a child waiting on an event
        c.execute("""SELECT flow.complete(%s, %s, '{"done": 1}', NULL,
                       '[{"name": "work", "args": {"k": "child"}, "key": "child",
                          "waits": [{"name": "go", "key": "child"}], "within": "1 hour"}]')""", (ok_id, ok_token))
        c.execute("SELECT flow.fail(%s, %s, 'no', permanent => true)", (bad_id, bad_token))
        cancelled = c.execute("SELECT flow.enqueue('work', '{\"k\": \"never\"}')").fetchone()[0]
        c.execute("SELECT flow.cancel(%s)", (cancelled,))
        c.execute("SELECT flow.emit('unrelated', 'k', '{\"x\": 1}')")
        states = dict(c.execute("SELECT status::text, count(*) FROM flow._commands GROUP BY 1").fetchall())
        assert states == {"pending": 5, "running": 1, "succeeded": 1, "failed": 1, "cancelled": 1, "waiting": 1}

    # the workers wait calmly: the old SQL is not what this library runs
    assert pg.one("SELECT count(*) FROM flow._commands WHERE status = 'running'") == 1
    time.sleep(2)   # (time itself: nothing runs within 2 s)
    assert pg.one("SELECT count(*) FROM app.effects") == 0
    assert f"the installed extension is version {oldest}, this library is {CURRENT}" in pg.log()

    with pg.connect() as c:
        c.execute("ALTER EXTENSION flow UPDATE")
        assert c.execute("SELECT extversion FROM pg_extension WHERE extname = 'flow'").fetchone()[0] == CURRENT
        c.execute("DROP DATABASE IF EXISTS fresh")
        c.execute("CREATE DATABASE fresh")
    with psycopg.connect(pg.conninfo().replace("dbname=postgres", "dbname=fresh"), autocommit=True) as f:
        f.execute("CREATE EXTENSION flow")
    # what pg_dump keeps of flow's tables (binary-upgrade mode hides it among OIDs)
    dumped = ("SELECT array_agg(c.t || ':' || c.w ORDER BY c.t) FROM pg_extension e,"
              " unnest(e.extconfig::regclass[]::text[], e.extcondition) AS c(t, w) WHERE e.extname = 'flow'")
    with psycopg.connect(pg.conninfo().replace("dbname=postgres", "dbname=fresh"), autocommit=True) as f:
        assert pg.all(dumped) == f.execute(dumped).fetchall()
    updated, fresh = flow_schema(pg, "postgres"), flow_schema(pg, "fresh")
    if updated != fresh:
        import difflib
        diff = "\n".join(difflib.unified_diff(fresh.splitlines(), updated.splitlines(), "fresh", "updated", lineterm=""))
        pytest.fail(f"the updated schema differs from a fresh install:\n{diff[:8000]}")

    # the old runs finish under the new code
    for run in pending + [later]:
        assert pg.await_run(run)[0] == "succeeded"
    pg.one("SELECT flow.complete(%s, %s, '{\"late\": true}')", open_id, open_token)
    assert pg.await_run(open_run)[0] == "succeeded"
    # a success is known by its lease whichever release settled it (the old one
    # wrote an attempt row, the new one keeps the token on the command): a second
    # completion is a double completion, and each shows one succeeded attempt
    for done_id, done_token in ((ok_id, ok_token), (open_id, open_token)):
        assert pg.sqlstate("SELECT flow.complete(%s, %s)", done_id, done_token) == "FL017"
        assert pg.all("SELECT state, outcome FROM flow.resolve(%s, %s)", done_id, done_token) == \
            [("concluded", "succeeded")]
        assert pg.all("SELECT outcome FROM flow.attempts WHERE command_id = %s", done_id) == [("succeeded",)]
    pg.one("SELECT flow.emit('go', 'child')")
    assert pg.await_run(ok_run)[0] == "succeeded"
    assert pg.await_run(bad_run)[0] == "failed"
    assert pg.await_run(cancelled)[0] == "cancelled"
    assert sorted(r[0] for r in pg.all("SELECT key FROM app.effects")) == ["child", "later", "p0", "p1", "p2"]
    # the fourth external run is still there to claim
    rows = pg.all("SELECT command_id, lease_token FROM flow.claim(array['ext'], 'up-2', 10)")
    assert len(rows) == 1

    # The roots of the old runs keep their own ids; a new run's root takes the
    # run's (sql/schema.sql, _commands_run_key). Both kinds are found by run,
    # counted by flow.runs, and pruned with their runs.
    old_root, old_key = pg.all("SELECT id, key FROM flow.commands WHERE run_id = %s", pending[0])[0]
    assert (old_root != pending[0]) == roots_have_own_ids and old_key == "root"
    assert pg.one("SELECT attempts FROM flow.runs WHERE id = %s", pending[0]) == 1
    assert sorted(pg.one("SELECT array_agg(key) FROM flow.commands WHERE run_id = %s", ok_run)) == ["child", "root"]
    new = pg.one("SELECT flow.enqueue('work', '{\"k\": \"new\"}')")
    assert pg.await_run(new)[0] == "succeeded"
    assert pg.all("SELECT id, key FROM flow.commands WHERE run_id = %s", new) == [(new, "root")]
    assert pg.one("SELECT attempts FROM flow.runs WHERE id = %s", new) == 1
    finished = pg.one("SELECT count(*) FROM flow._run_rows WHERE status <> 'running'")
    assert pg.one("SELECT pruned FROM flow._prune('0 s', 1000, NULL)") == finished
    assert pg.one("SELECT count(*) FROM flow._runs WHERE id = ANY (%s)", [pending[0], ok_run, new]) == 0
    assert pg.one("SELECT count(*) FROM flow._commands WHERE run_id = ANY (%s)", [pending[0], ok_run, new]) == 0
    assert pg.one("SELECT count(*) FROM flow._commands c"
                  " WHERE NOT EXISTS (SELECT 1 FROM flow._run_rows r WHERE r.id = c.run_id)") == 0
