"""Every public function, called by an attacker (a role with only the database
defaults) with adversarial arguments, one at a time: NULLs, empty and 1 MB
strings, unicode, SQL fragments, huge and deeply nested JSON, zero, negative,
huge and infinite intervals and timestamps, extreme integers, empty arrays and
arrays of NULL. Each call either works or raises a clean ERROR (flow's own
SQLSTATE, or PostgreSQL's for a value the type itself rejects) and, when it
fails, changes nothing. The postmaster never restarts and the workers keep
draining other work."""
import re
import uuid

import psycopg
import pytest

from conftest import fresh_cluster, unique

BIG = "x" * (1 << 20)
TEXT = [None, "", " ", "x", BIG, "ünï\u200bcødé 🙂", "'; DROP TABLE flow._runs; --", "%s %I $1", "default",
        "PUBLIC", "pg_catalog", "postgres"]
JSONB = [None, "{}", "[]", "1", "null", '"s"', "[" * 2000 + "]" * 2000, '{"a": "' + BIG + '"}',
         '{"sql": "ALTER ROLE mallory SUPERUSER"}', '{"a": ' * 500 + "1" + "}" * 500]
INTERVAL = [None, "0", "-1 s", "1 microsecond", "1 s", "300000 years", "-300000 years", "178000000 years"]
TIMESTAMPTZ = [None, "infinity", "-infinity", "294276-12-31", "4713-01-01 BC", "2000-01-01", "now"]
INTEGER = [None, 0, -1, 1, 2147483647, -2147483648]
BOOLEAN = [None, True, False]
UUID = [None, "00000000-0000-0000-0000-000000000000", str(uuid.uuid4())]
REGPROC = [None, "flow.noop(jsonb)", "flow.run_sql(jsonb)", "pg_catalog.pg_sleep(double precision)",
           "pg_catalog.pg_terminate_backend(integer, bigint)", "flow.enqueue(text,jsonb,text,integer,text,interval,timestamp with time zone,interval,bigint)"]
TEXT_ARRAY = [None, "{}", "{NULL}", '{""}', "{" + BIG + "}"]
JSONB_ARRAY = [None, "{}", "{NULL}", '{"[]"}', '{"{}"}']
UUID_ARRAY = [None, "{}", "{NULL}", "{00000000-0000-0000-0000-000000000000}"]
WAIT_ARRAY = [None, "{}", '{"(,)"}', '{"(a,)"}', '{"(,b)"}']
REGTYPE = [None, "integer", "jsonb", "pg_catalog.pg_class", "flow.context", "flow._runs"]
VALUES = {"regtype": REGTYPE, "text": TEXT, "jsonb": JSONB, "interval": INTERVAL, "timestamptz": TIMESTAMPTZ, "integer": INTEGER,
          "boolean": BOOLEAN, "uuid": UUID, "regprocedure": REGPROC, "text[]": TEXT_ARRAY, "jsonb[]": JSONB_ARRAY,
          "uuid[]": UUID_ARRAY, "flow.wait_spec[]": WAIT_ARRAY}

# function, [(parameter, type, sane value)]; @name stands for a value the test makes
SIGNATURES = [
    ("flow.define", [("name", "text", "@fresh"), ("handler", "regprocedure", "flow.run_sql(jsonb)"),
                     ("version", "integer", 1), ("queue", "text", "@queue"), ("max_attempts", "integer", 3),
                     ("backoff", "interval", "1 s"), ("backoff_max", "interval", "1 hour"),
                     ("max_elapsed", "interval", None), ("timeout", "interval", None),
                     ("args_type", "regtype", None), ("priority", "integer", 0)]),
    ("flow.set_queue", [("name", "text", "@queue"), ("concurrency", "integer", None), ("paused", "boolean", None),
                        ("rate", "integer", None), ("per", "interval", "1 s"), ("group_concurrency", "integer", None)]),
    ("flow.schedule", [("name", "text", "@fresh"), ("cron", "text", "0 0 1 1 *"), ("definition", "text", "@definition"),
                       ("args", "jsonb", "{}"), ("timezone", "text", "UTC"), ("queue", "text", None),
                       ("overlap", "boolean", True), ("catch_up", "integer", 0)]),
    ("flow.unschedule", [("name", "text", "@fresh")]),
    ("flow.pause_schedule", [("name", "text", "@fresh"), ("paused", "boolean", True)]),
    ("flow.drop_queue", [("name", "text", "@queue")]),
    ("flow.grant_definition", [("name", "text", "@definition"), ("role", "text", "alice")]),
    ("flow.revoke_definition", [("name", "text", "@definition"), ("role", "text", "alice")]),
    ("flow.grant_queue", [("name", "text", "@queue"), ("role", "text", "alice")]),
    ("flow.revoke_queue", [("name", "text", "@queue"), ("role", "text", "alice")]),
    ("flow.enqueue", [("name", "text", "@definition"), ("args", "jsonb", '{"sql": "SELECT 1"}'),
                      ("key", "text", None), ("version", "integer", None), ("queue", "text", None),
                      ("start_after", "interval", "1 hour"), ("run_at", "timestamptz", None),
                      ("deadline", "interval", None), ("priority", "integer", None), ("group_key", "text", None)]),
    ("flow.enqueue_many", [("name", "text", "@definition"), ("args_array", "jsonb[]", "{}"),
                           ("version", "integer", None), ("queue", "text", None),
                           ("start_after", "interval", "1 hour"), ("run_at", "timestamptz", None),
                           ("deadline", "interval", None), ("priority", "integer", None), ("group_key", "text", None),
                           ("group_keys", "text[]", None)]),
    ("flow.cancel", [("run_id", "uuid", "@victim")]),
    ("flow.retry", [("run_id", "uuid", "@victim")]),
    ("flow.await", [("run_id", "uuid", "@victim"), ("timeout", "interval", "0")]),
    ("flow.emit", [("name", "text", "fz_event"), ("key", "text", "k"), ("payload", "jsonb", "{}")]),
    ("flow.wait", [("name", "text", "e"), ("key", "text", "k")]),
    ("flow.spawn", [("name", "text", "@definition"), ("args", "jsonb", "{}"), ("key", "text", "k"),
                    ("start_after", "interval", None), ("waits", "flow.wait_spec[]", "{}"),
                    ("within", "interval", None), ("version", "integer", None), ("queue", "text", None),
                    ("priority", "integer", None), ("group_key", "text", None)]),
    ("flow.spawn_many", [("name", "text", "@definition"), ("args_array", "jsonb[]", "{\"{}\"}"), ("keys", "text[]", "{k}"),
                         ("start_after", "interval", None), ("waits", "flow.wait_spec[]", "{}"),
                         ("within", "interval", None), ("version", "integer", None), ("queue", "text", None),
                         ("priority", "integer", None), ("group_key", "text", None), ("group_keys", "text[]", None)]),
    ("flow.run_graph", [("run_id", "uuid", "@victim"), ("format", "text", "dot")]),
    ("flow.fail", [("message", "text", "m")]),
    ("flow.retry_after", [("delay", "interval", "1 s"), ("message", "text", "m")]),
    ("flow.claim", [("names", "text[]", "{@external}"), ("worker", "text", "w"), ("max", "integer", 1),
                    ("lease", "interval", "1 minute")]),
    ("flow.heartbeat", [("command_id", "uuid", "@command"), ("lease_token", "uuid", "@token"),
                        ("extend", "interval", None)]),
    ("flow.resolve", [("command_id", "uuid", "@command"), ("lease_token", "uuid", "@token")]),
    ("flow.complete", [("command_id", "uuid", "@command"), ("lease_token", "uuid", "@token"),
                       ("result", "jsonb", None), ("events", "jsonb", None), ("children", "jsonb", None)]),
    ("flow.complete_many", [("command_ids", "uuid[]", "{@command}"), ("lease_tokens", "uuid[]", "{@token}"),
                            ("results", "jsonb[]", None)]),
    ("flow.fail", [("command_id", "uuid", "@command"), ("lease_token", "uuid", "@token"), ("message", "text", "m"),
                   ("retry_after", "interval", None), ("permanent", "boolean", False), ("code", "text", None)]),
]

# a value the type itself rejects is PostgreSQL's clean error; 54001: JSON nested too deep;
# 2BP01: a queue still in use is not dropped
POSTGRES_OK = {"42501", "42704", "42883", "54001", "42P13", "2BP01"}
STATE = """SELECT (SELECT count(*) FROM flow._definitions), (SELECT count(*) FROM flow._definition_names),
                  (SELECT count(*) FROM flow._queues), (SELECT count(*) FROM flow._runs), (SELECT count(*) FROM flow._run_rows),
                  (SELECT count(*) FROM flow._commands), (SELECT count(*) FROM flow._attempts),
                  (SELECT count(*) FROM flow._events), (SELECT count(*) FROM flow._waits),
                  (SELECT md5(string_agg(x::text, ',' ORDER BY x::text)) FROM flow._schedules x),
                  (SELECT md5(string_agg(x::text, ',' ORDER BY x::text)) FROM flow._queues x),
                  (SELECT md5(string_agg(x::text, ',' ORDER BY x::text)) FROM flow._commands x
                   WHERE x.status = 'running')"""


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2")
    with cluster.connect() as c:
        c.execute("CREATE ROLE alice LOGIN; CREATE ROLE mallory LOGIN;"
                  " GRANT EXECUTE ON FUNCTION flow.run_sql(jsonb) TO mallory")
    yield cluster
    cluster.stop()


def test_every_public_function_survives_adversarial_arguments(pg):
    started = pg.one("SELECT pg_postmaster_start_time()")
    workers = sorted(pg.worker_pids())
    pg.one("SELECT flow.define('victim', 'flow.noop'::regproc)")
    victim = pg.one("SELECT flow.enqueue('victim')")
    assert pg.await_run(victim)[0] == "succeeded"
    unexpected = []
    calls = 0
    # the workers pause, so what a failed call left unchanged is exactly comparable
    pg.all("ALTER SYSTEM SET flow.enabled = off")
    pg.all("SELECT pg_reload_conf()")
    with pg.connect("mallory") as m, pg.connect() as su:
        m.execute("SET statement_timeout = '10s'")
        definition, external, queue = unique("fz"), unique("fzx"), unique("fzq")
        m.execute(f"SELECT flow.define('{definition}', 'flow.run_sql'::regproc, queue => '{queue}')")
        m.execute(f"SELECT flow.define('{external}', NULL, queue => '{queue}')")
        m.execute(f"SELECT flow.enqueue_many('{external}', array_fill('{{}}'::jsonb, array[3000]))")

        def fresh_lease():
            # an earlier call may have paused or limited the queue, or its rate (it is mallory's)
            m.execute(f"SELECT flow.set_queue('{queue}', concurrency => NULL, paused => false, rate => NULL,"
                      " group_concurrency => NULL)")
            return m.execute(f"SELECT command_id, lease_token FROM flow.claim(array['{external}'], 'fz', 1, '1 hour')"
                             ).fetchone()

        for function, params in SIGNATURES:
            for i, (param, type_, _) in enumerate(params):
                for value in VALUES[type_]:
                    command, token = fresh_lease()
                    sane = {"fresh": unique("fresh"), "definition": definition, "external": external,
                            "queue": queue, "victim": victim, "command": command, "token": token}
                    args, sql_args = [], []
                    for j, (p, t, default) in enumerate(params):
                        v = value if j == i else default
                        if j != i and isinstance(v, str):
                            v = re.sub(r"@(\w+)", lambda g: str(sane[g.group(1)]), v)
                        args.append(f"{p} => %s::{t}")
                        sql_args.append(v)
                    query = f"SELECT {function}({', '.join(args)})"
                    before = su.execute(STATE).fetchone()
                    calls += 1
                    try:
                        m.execute(query, sql_args)
                    except psycopg.Error as e:
                        code = e.sqlstate or "?"
                        clean = code.startswith("FL") or code.startswith("22") or code in POSTGRES_OK
                        after = su.execute(STATE).fetchone()
                        if not clean or after != before:
                            unexpected.append((function, param, repr(value)[:60], code,
                                               str(e).splitlines()[0][:160], after == before))
    pg.all("ALTER SYSTEM RESET flow.enabled")
    pg.all("SELECT pg_reload_conf()")
    assert calls > 500
    assert not unexpected, "\n".join(map(str, unexpected))
    # nothing went down, and the engine still drains other roles' work
    assert pg.one("SELECT pg_postmaster_start_time()") == started
    assert sorted(pg.worker_pids()) == workers
    pg.one("SELECT flow.define('after_fuzz', 'flow.noop'::regproc)", user="alice")
    runs = pg.one("SELECT flow.enqueue_many('after_fuzz', array_fill('{}'::jsonb, array[50]))", user="alice")
    for run in runs:
        assert pg.await_run(run, user="alice")[0] == "succeeded"
    assert pg.one("SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'") is False


def test_every_public_function_is_fuzzed(pg):
    public = {r[0] for r in pg.all("SELECT 'flow.' || p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                                   " WHERE n.nspname = 'flow' AND left(p.proname, 1) <> '_'"
                                   " AND has_function_privilege('mallory', p.oid, 'EXECUTE')")}
    handlers = {"flow.noop", "flow.run_sql"}   # built-in handlers, not API (run_sql is granted to mallory here)
    assert public - handlers <= {name for name, _ in SIGNATURES}, public - handlers - {n for n, _ in SIGNATURES}
