"""The public SQL API: loading, settings, definitions, queues, enqueue,
typed arguments, and what bad input to each function raises (and that it
changes nothing). (Its fuzzing: test_fuzz.py; its golden file:
golden/api.sql, run by test_golden.py.)"""
import re
import threading
import uuid

import psycopg
import pytest

from conftest import ROOT, Cluster, app_cluster, external, unique

API_APP = """
    CREATE OR REPLACE FUNCTION app.ok(args jsonb) RETURNS jsonb LANGUAGE sql AS 'SELECT args';
    CREATE OR REPLACE FUNCTION app.ok_ctx(args jsonb, ctx flow.context) RETURNS void
        LANGUAGE sql AS 'SELECT';
    CREATE OR REPLACE FUNCTION app.two_ints(a int, b int) RETURNS jsonb LANGUAGE sql AS 'SELECT NULL::jsonb';
    CREATE OR REPLACE FUNCTION app.returns_int(args jsonb) RETURNS int LANGUAGE sql AS 'SELECT 1';
    CREATE OR REPLACE FUNCTION app.set_returning(args jsonb) RETURNS SETOF jsonb LANGUAGE sql AS 'SELECT args';
    CREATE OR REPLACE PROCEDURE app.proc(args jsonb) LANGUAGE sql AS 'SELECT 1';
    DO $$ BEGIN
        CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;
    EXCEPTION WHEN duplicate_object THEN NULL; END $$;
    GRANT USAGE ON SCHEMA app TO alice, bob;
"""


@pytest.fixture(scope="module")
def pg():
    """Handlers for this module; definitions here are external (no in-database
    worker runs them) so runs stay put for inspection unless a test says so."""
    cluster = app_cluster(API_APP)
    yield cluster
    cluster.stop()


def counts(pg):
    return pg.all("SELECT (SELECT count(*) FROM flow._run_rows), (SELECT count(*) FROM flow._commands),"
                  " (SELECT count(*) FROM flow._definitions), (SELECT count(*) FROM flow._queues)")[0]


# ---------------------------------------------------------------- loading

def test_extension_is_installed_with_workers(app):
    version = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    assert app.one("SELECT extversion FROM pg_extension WHERE extname = 'flow'") == version
    assert app.one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'flow worker'") == 2
    assert app.one("SELECT count(*) FROM flow.workers WHERE pid IS NOT NULL") == 2


def test_loading_without_preload_is_a_clear_error(tmp_path):
    bare = Cluster("/tmp/flow-bare", 5497)
    bare.start(FLOW_PRELOAD="0")
    try:
        with bare.connect() as c:
            with pytest.raises(psycopg.Error) as caught:
                c.execute("CREATE EXTENSION flow")
        assert "shared_preload_libraries" in str(caught.value)
        assert bare.one("SELECT count(*) FROM pg_extension WHERE extname = 'flow'") == 0
    finally:
        bare.stop()


def test_gucs_are_registered_with_units_and_contexts(app):
    rows = dict((r[0], r[1:]) for r in app.all(
        "SELECT name, setting, unit, context FROM pg_settings WHERE name LIKE 'flow.%'"))
    assert rows["flow.workers"] == ("2", None, "postmaster")
    assert rows["flow.enabled"] == ("on", None, "sighup")
    assert rows["flow.poll_interval"][1:] == ("ms", "sighup")
    assert rows["flow.batch_size"][2] == "sighup"
    assert rows["flow.lease_duration"][1:] == ("s", "sighup")
    assert rows["flow.max_result_bytes"] == ("262144", "B", "superuser")
    assert rows["flow.database_name"] == ("postgres", None, "postmaster")
    assert "flow.fault_points" in rows and "flow.log_level" in rows
    assert app.sqlstate("SET flow.batch_size = 0") in ("22023", "55P02")


def test_ids_are_uuid_v7(app):
    name = external(app)
    run = app.one("SELECT flow.enqueue(%s)", name)
    assert uuid.UUID(str(run)).version == 7


# ---------------------------------------------------------------- define

def test_define_records_owner_and_policy(app):
    name = unique("def")
    app.one(f"SELECT flow.define('{name}', 'app.ok'::regproc, version => 2, queue => 'mail', max_attempts => 7,"
            " backoff => '2s', backoff_max => '1 min', max_elapsed => '1 day', timeout => '30s')")
    row = app.all("SELECT handler::text, owner::text, queue, max_attempts, backoff, backoff_max, max_elapsed,"
                  " timeout, takes_context FROM flow.definitions WHERE name = %s", name)[0]
    assert row[0] == "app.ok(jsonb)" and row[1] == "postgres" and row[2] == "mail" and row[3] == 7
    assert str(row[4]) == "0:00:02" and str(row[5]) == "0:01:00" and str(row[7]) == "0:00:30"
    assert row[8] is False
    assert app.one("SELECT count(*) FROM flow.queues WHERE name = 'mail'") == 1


def test_define_accepts_a_context_handler_returning_void(app):
    name = unique("ctx")
    app.one(f"SELECT flow.define('{name}', 'app.ok_ctx'::regproc)")
    assert app.one("SELECT takes_context FROM flow.definitions WHERE name = %s", name) is True


def test_redefine_by_owner_updates(app):
    name = unique("re")
    app.one(f"SELECT flow.define('{name}', 'app.ok'::regproc, max_attempts => 2)")
    app.one(f"SELECT flow.define('{name}', 'app.ok'::regproc, max_attempts => 9)")
    assert app.all("SELECT max_attempts FROM flow.definitions WHERE name = %s", name) == [(9,)]


def test_another_role_cannot_hijack_a_definition(app):
    name = unique("mine")
    app.one("GRANT EXECUTE ON FUNCTION app.ok(jsonb) TO alice, bob")
    app.one(f"SELECT flow.define('{name}', 'app.ok'::regproc)", user="alice")
    before = counts(app)
    assert app.sqlstate(f"SELECT flow.define('{name}', 'app.ok'::regproc, max_attempts => 1)", user="bob") == "FL011"
    assert app.sqlstate(f"SELECT flow.define('{name}', 'app.ok'::regproc, version => 2)", user="bob") == "FL011"
    assert counts(app) == before
    assert app.one("SELECT owner::regrole::text FROM flow._definitions WHERE name = %s", name) == "alice"


@pytest.mark.parametrize("handler", ["app.two_ints(int,int)", "app.returns_int(jsonb)",
                                     "app.set_returning(jsonb)", "app.proc(jsonb)"])
def test_define_rejects_a_wrong_signature(app, handler):
    before = counts(app)
    assert app.sqlstate(f"SELECT flow.define('{unique()}', '{handler}'::regprocedure)") == "FL008"
    assert counts(app) == before


def test_define_rejects_a_missing_handler(app):
    assert app.sqlstate(f"SELECT flow.define('{unique()}', 'app.nope'::regproc)") == "42883"


@pytest.mark.parametrize("args,code", [
    ("NULL, 'app.ok'::regproc", "FL002"),
    ("'', 'app.ok'::regproc", "FL002"),
    ("'x_bad', 'app.ok'::regproc, queue => ''", "FL002"),
    ("'x_bad', 'app.ok'::regproc, max_attempts => 0", "FL015"),
    ("'x_bad', 'app.ok'::regproc, backoff => '0s'", "FL015"),
    ("'x_bad', 'app.ok'::regproc, backoff => '2h', backoff_max => '1h'", "FL015"),
    ("'x_bad', 'app.ok'::regproc, timeout => '-1s'", "FL015"),
    ("'x_bad', 'app.ok'::regproc, version => 0", "FL015"),
])
def test_define_bad_input(app, args, code):
    before = counts(app)
    assert app.sqlstate(f"SELECT flow.define({args})") == code
    assert counts(app) == before


def test_define_needs_execute_on_the_handler(app):
    app.one("REVOKE EXECUTE ON FUNCTION app.returns_int(jsonb) FROM PUBLIC")
    app.one("CREATE OR REPLACE FUNCTION app.secret(args jsonb) RETURNS jsonb LANGUAGE sql AS 'SELECT args'")
    app.one("REVOKE EXECUTE ON FUNCTION app.secret(jsonb) FROM PUBLIC")
    assert app.sqlstate(f"SELECT flow.define('{unique()}', 'app.secret'::regproc)", user="bob") == "42501"


# ---------------------------------------------------------------- queues

def test_set_queue(app):
    q = unique("q")
    app.one(f"SELECT flow.set_queue('{q}', concurrency => 3)")
    assert app.all("SELECT concurrency, paused FROM flow.queues WHERE name = %s", q) == [(3, False)]
    app.one(f"SELECT flow.set_queue('{q}', concurrency => 3, paused => true)")
    assert app.all("SELECT concurrency, paused FROM flow.queues WHERE name = %s", q) == [(3, True)]


def test_set_queue_keeps_the_options_it_is_not_given(app):
    """Pausing a queue keeps its limit (0.2.0 dropped it: concurrency's
    default, NULL, also meant "no limit"); a NULL given removes it."""
    q = unique("q")
    app.one(f"SELECT flow.set_queue('{q}', concurrency => 4)")
    app.one(f"SELECT flow.set_queue('{q}', paused => true)")
    assert app.all("SELECT concurrency, paused FROM flow.queues WHERE name = %s", q) == [(4, True)]
    app.one(f"SELECT flow.set_queue('{q}')")
    assert app.all("SELECT concurrency, paused FROM flow.queues WHERE name = %s", q) == [(4, True)]
    app.one(f"SELECT flow.set_queue('{q}', paused => false, concurrency => NULL)")
    assert app.all("SELECT concurrency, paused FROM flow.queues WHERE name = %s", q) == [(None, False)]
    app.one(f"SELECT flow.set_queue(name => '{q}', concurrency => 2)")
    app.one(f"SELECT flow.set_queue('{q}', NULL, true)")   # (by position: given, so no limit)
    assert app.all("SELECT concurrency, paused FROM flow.queues WHERE name = %s", q) == [(None, True)]


@pytest.mark.parametrize("args,code", [("'qq', concurrency => 0", "FL009"), ("'qq', concurrency => -5", "FL009"),
                                       ("NULL", "FL002"), ("''", "FL002")])
def test_set_queue_bad_input(app, args, code):
    before = counts(app)
    assert app.sqlstate(f"SELECT flow.set_queue({args})") == code
    assert counts(app) == before


# ---------------------------------------------------------------- enqueue

def test_enqueue_creates_a_run_and_its_root_command(app):
    name = external(app)
    run = app.one(f"SELECT flow.enqueue('{name}', '{{\"user\": 42}}', start_after => '5 min', deadline => '1 hour')")
    status, args, deadline_ok = app.all(
        "SELECT status, args, deadline BETWEEN now() + interval '59 min' AND now() + interval '61 min'"
        " FROM flow.runs WHERE id = %s", run)[0]
    assert status == "running" and args == {"user": 42} and deadline_ok
    cmd = app.all("SELECT key, status, attempts, next_run_at > now() + interval '4 min' FROM flow.commands"
                  " WHERE run_id = %s", run)
    assert cmd == [("root", "pending", 0, True)]


def test_enqueue_uses_the_newest_version_unless_told(app):
    name = external(app)
    app.one(f"SELECT flow.define('{name}', NULL, version => 3)")
    newest = app.one(f"SELECT flow.enqueue('{name}')")
    first = app.one(f"SELECT flow.enqueue('{name}', version => 1)")
    assert app.one("SELECT version FROM flow.runs WHERE id = %s", newest) == 3
    assert app.one("SELECT version FROM flow.runs WHERE id = %s", first) == 1


def test_enqueue_at_a_time_and_on_another_queue(app):
    name = external(app)
    run = app.one(f"SELECT flow.enqueue('{name}', run_at => now() + interval '1 day', queue => 'other')")
    row = app.all("SELECT queue, next_run_at > now() + interval '23 hours' FROM flow.commands WHERE run_id = %s",
                  run)
    assert row == [("other", True)]


def test_run_key_is_idempotent(app):
    name = external(app)
    key = unique("k")
    a = app.one(f"SELECT flow.enqueue('{name}', '{{\"a\": 1}}', key => '{key}')")
    b = app.one(f"SELECT flow.enqueue('{name}', '{{\"a\": 1}}', key => '{key}')")
    assert a == b
    assert app.one("SELECT count(*) FROM flow.runs WHERE key = %s", key) == 1


def test_run_key_with_another_declaration_conflicts(app):
    name = external(app)
    key = unique("k")
    app.one(f"SELECT flow.enqueue('{name}', '{{\"a\": 1}}', key => '{key}')")
    before = counts(app)
    assert app.sqlstate(f"SELECT flow.enqueue('{name}', '{{\"a\": 2}}', key => '{key}')") == "FL010"
    assert app.sqlstate(f"SELECT flow.enqueue('{name}', '{{\"a\": 1}}', key => '{key}', queue => 'x')") == "FL010"
    assert counts(app) == before


def test_run_keys_belong_to_their_role(app):
    name = unique("shared")
    app.one(f"SELECT flow.define('{name}', 'app.ok'::regproc)")
    app.one(f"SELECT flow.grant_definition('{name}', 'PUBLIC')")
    app.one("SELECT flow.set_queue('default', paused => true)")
    key = unique("k")
    a = app.one(f"SELECT flow.enqueue('{name}', key => '{key}')", user="alice")
    b = app.one(f"SELECT flow.enqueue('{name}', key => '{key}')", user="bob")
    assert a != b
    app.one("SELECT flow.set_queue('default', paused => false)")


def test_only_the_owner_and_granted_roles_start_a_definition(app):
    name = unique("private")
    app.one("CREATE OR REPLACE FUNCTION app.private(args jsonb) RETURNS jsonb LANGUAGE sql AS 'SELECT args'")
    app.one(f"SELECT flow.define('{name}', 'app.private'::regproc)")
    ext = external(app)
    before = counts(app)
    # to another role a definition it may not start does not exist (no probing of names)
    assert app.sqlstate(f"SELECT flow.enqueue('{name}')", user="bob") == "FL001"
    assert app.sqlstate(f"SELECT flow.enqueue_many('{name}', array['{{}}'::jsonb])", user="bob") == "FL001"
    assert app.sqlstate(f"SELECT flow.enqueue('{ext}')", user="bob") == "FL001"
    assert app.sqlstate(f"SELECT flow.grant_definition('{name}', 'bob')", user="bob") == "FL001"
    assert counts(app) == before
    app.one(f"SELECT flow.grant_definition('{name}', 'bob')")
    assert app.one(f"SELECT flow.enqueue('{name}')", user="bob") is not None
    assert app.sqlstate(f"SELECT flow.enqueue('{name}')", user="alice") == "FL001"
    app.one(f"SELECT flow.revoke_definition('{name}', 'bob')")
    assert app.sqlstate(f"SELECT flow.enqueue('{name}')", user="bob") == "FL001"
    assert app.sqlstate(f"SELECT flow.grant_definition('{name}', 'nobody_such')") == "42704"


def test_concurrent_same_key_enqueues_return_one_run(app):
    name = external(app)
    key = unique("k")
    barrier = threading.Barrier(2)
    results, errors = [], []
    first = app.connect(autocommit=False)
    # The first session holds its uncommitted run; the second must wait for it
    # and then return the same id, not a second run or an error.
    results.append(first.execute(f"SELECT flow.enqueue('{name}', key => '{key}')").fetchone()[0])

    def second():
        try:
            with app.connect() as c:
                barrier.wait()
                results.append(c.execute(f"SELECT flow.enqueue('{name}', key => '{key}')").fetchone()[0])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=second)
    t.start()
    barrier.wait()
    t.join(0.5)
    assert t.is_alive(), "the second enqueue should wait for the first transaction"
    first.commit()
    t.join(10)
    first.close()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert app.one("SELECT count(*) FROM flow.runs WHERE key = %s", key) == 1


def test_many_concurrent_same_key_enqueues(app):
    name = external(app)
    key = unique("k")
    ids, errors = [], []

    def enqueue():
        try:
            with app.connect() as c:
                ids.append(c.execute(f"SELECT flow.enqueue('{name}', key => '{key}')").fetchone()[0])
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=enqueue) for _ in range(8)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert not errors and len(ids) == 8 and len(set(ids)) == 1
    assert app.one("SELECT count(*) FROM flow.runs WHERE key = %s", key) == 1


@pytest.mark.parametrize("call,code", [
    ("flow.enqueue('no_such_definition')", "FL001"),
    ("flow.enqueue('{name}', version => 99)", "FL001"),
    ("flow.enqueue(NULL)", "FL002"),
    ("flow.enqueue('')", "FL002"),
    ("flow.enqueue('{name}', key => '')", "FL002"),
    ("flow.enqueue('{name}', '[1, 2]')", "FL003"),
    ("flow.enqueue('{name}', '\"text\"')", "FL003"),
    ("flow.enqueue('{name}', NULL)", "FL003"),
    ("flow.enqueue('{name}', jsonb_build_object('big', repeat('x', 300000)))", "FL004"),
    ("flow.enqueue('{name}', start_after => '-1 second')", "FL005"),
    ("flow.enqueue('{name}', start_after => '1 min', run_at => now())", "FL006"),
    ("flow.enqueue('{name}', deadline => '-1 hour')", "FL007"),
    ("flow.enqueue('{name}', deadline => '0 s')", "FL007"),
    ("flow.enqueue('{name}', start_after => '2 hours', deadline => '1 hour')", "FL007"),
])
def test_enqueue_bad_input_changes_nothing(app, call, code):
    name = external(app)
    before = counts(app)
    assert app.sqlstate("SELECT " + call.format(name=name)) == code
    assert counts(app) == before


def test_enqueue_many_in_one_statement(app):
    name = external(app)
    ids = app.one(f"SELECT flow.enqueue_many('{name}', array_agg(jsonb_build_object('i', i)))"
                  " FROM generate_series(1, 5000) i")
    assert len(ids) == 5000 and len(set(ids)) == 5000
    assert app.one("SELECT count(*) FROM flow.commands c JOIN unnest(%s::uuid[]) r(id) ON r.id = c.run_id", ids) == 5000
    # ids come back in the order of args_array
    assert app.one("SELECT args->>'i' FROM flow.runs WHERE id = %s", ids[41]) == "42"


@pytest.mark.parametrize("array,code", [
    ("array['{}'::jsonb, '[]'::jsonb]", "FL003"),
    ("array['{}'::jsonb, NULL]", "FL003"),
    ("NULL::jsonb[]", "FL003"),
    ("array[jsonb_build_object('big', repeat('x', 300000))]", "FL004"),
])
def test_enqueue_many_bad_input_changes_nothing(app, array, code):
    name = external(app)
    before = counts(app)
    assert app.sqlstate(f"SELECT flow.enqueue_many('{name}', {array})") == code
    assert counts(app) == before


def test_enqueue_many_of_nothing(app):
    name = external(app)
    assert app.one(f"SELECT flow.enqueue_many('{name}', '{{}}'::jsonb[])") == []


def test_views_show_status_attempts_timestamps_and_errors(app):
    cols = [r[0] for r in app.all("SELECT column_name FROM information_schema.columns"
                                   " WHERE table_schema = 'flow' AND table_name = 'runs'")]
    for col in ("id", "status", "attempts", "created_at", "finished_at", "result", "last_error"):
        assert col in cols
    cols = [r[0] for r in app.all("SELECT column_name FROM information_schema.columns"
                                   " WHERE table_schema = 'flow' AND table_name = 'commands'")]
    for col in ("status", "attempts", "next_run_at", "result", "last_error_message", "stop_reason"):
        assert col in cols


def test_ordinary_roles_cannot_write_flow_tables(app):
    for table in ("_runs", "_commands", "_definitions", "_queues", "_attempts", "_events", "_waits"):
        assert app.sqlstate(f"DELETE FROM flow.{table}", user="bob") == "42501"
        assert app.sqlstate(f"SELECT * FROM flow.{table}", user="bob") == "42501"
    for view in ("_run_rows", "_command_rows", "_held_attempts"):   # what flow's own views read
        assert app.sqlstate(f"SELECT * FROM flow.{view}", user="bob") == "42501"
    assert app.sqlstate("SELECT flow._enqueue(10, 'x', '{}', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
                        user="bob") == "42501"
    # the ticket cannot be forged
    name = external(app)
    assert app.sqlstate(f"SELECT flow.enqueue('{name}', caller_ticket => 12345)", user="bob") == "42501"


def test_the_event_journal_is_append_only(app):
    app.one("SELECT flow.emit('journal_test', 'k')")
    assert app.sqlstate("UPDATE flow._events SET key = 'x' WHERE name = 'journal_test'") == "55000"
    assert app.sqlstate("DELETE FROM flow._events WHERE name = 'journal_test'") == "55000"


# ---------------------------------------------------------------- typed arguments

def test_args_are_checked_against_the_definitions_args_type(pg):
    pg.all("CREATE TYPE app.order_args AS (order_id int, sku text)")
    pg.all("CREATE DOMAIN app.has_x AS jsonb CHECK (VALUE ? 'x')")
    name, loose = unique("typed"), unique("loose")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, args_type => 'app.order_args')")
    pg.one(f"SELECT flow.define('{loose}', 'flow.noop'::regproc, args_type => 'app.has_x')")
    assert pg.await_run(pg.one(f"""SELECT flow.enqueue('{name}', '{{"order_id": 7, "sku": "book"}}')"""))[0] == \
        "succeeded"
    before = pg.one("SELECT count(*) FROM flow._run_rows")
    for bad in ['{"order_id": "seven"}', '{"order_id": 7, "colour": "red"}']:
        assert pg.sqlstate(f"SELECT flow.enqueue('{name}', '{bad}')") == "FL019"
    assert pg.sqlstate(f"""SELECT flow.enqueue_many('{name}', array['{{"order_id": 1}}', '{{"order_id": "x"}}']::jsonb[])""") == "FL019"
    assert pg.sqlstate(f"SELECT flow.enqueue('{loose}', '{{\"y\": 1}}')") == "FL019"
    assert pg.one("SELECT count(*) FROM flow._run_rows") == before
    assert pg.sqlstate(f"SELECT flow.define('{unique('n')}', 'flow.noop'::regproc, args_type => 'integer')") == "FL015"


def test_args_are_checked_as_they_are(pg):
    """The args_type check sees the args exactly (not through doubles): a
    price of 1.10 has two decimal places, at enqueue and again before the
    attempt."""
    pg.all("CREATE DOMAIN app.cents AS numeric CHECK (scale(VALUE) = 2)")
    pg.all("CREATE TYPE app.priced AS (price app.cents)")
    name = unique("priced")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, args_type => 'app.priced')")
    assert pg.await_run(pg.one(f"""SELECT flow.enqueue('{name}', '{{"price": 1.10}}')"""))[0] == "succeeded"
    assert pg.sqlstate(f"""SELECT flow.enqueue('{name}', '{{"price": 1.1}}')""") == "FL019"


# ---------------------------------------------------------------- runs, events and children: bad input

def test_unknown_run(app):
    assert app.sqlstate("SELECT flow.cancel('00000000-0000-0000-0000-000000000000')") == "FL014"
    assert app.sqlstate("SELECT * FROM flow.await('00000000-0000-0000-0000-000000000000', '1s')") == "FL014"


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
