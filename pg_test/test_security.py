"""Hostile roles: alice and bob are ordinary users, mallory is an attacker with
only the database defaults (CONNECT, TEMP; no CREATE anywhere). Every attack
here was reproduced against 0.1.0 or 0.2.0; each test asserts its outcome: no
escalation, no effect on another role, no stall of the engine.
(src/gateway.rs and the README's security model say what holds and why.)"""
import threading
import time

import psycopg
import pytest

from conftest import EFFECTS, ENGINE_APP, define, enqueue, fresh_cluster, poll, unique


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2")
    with cluster.connect() as c:
        c.execute("""
            CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN; CREATE ROLE mallory LOGIN;
            -- alice and bob keep tables in public, and say so (their handlers
            -- get their own search_path; mallory's, none: "$user" alone)
            ALTER ROLE alice SET search_path = "$user", public;
            ALTER ROLE bob SET search_path = "$user", public;
            -- a DBA lets mallory schedule SQL of her own (pg_cron style): the attacks
            -- below must still run as mallory and nobody else
            GRANT EXECUTE ON FUNCTION flow.run_sql(jsonb) TO mallory;
            CREATE SCHEMA app;
            GRANT USAGE ON SCHEMA app TO alice, bob;
            CREATE TABLE public.ledger (who text, v int);
            GRANT SELECT, INSERT ON public.ledger TO alice, bob;
            CREATE TABLE app.parent (id int PRIMARY KEY);
            CREATE TABLE app.child (id int PRIMARY KEY,
                parent int REFERENCES app.parent DEFERRABLE INITIALLY DEFERRED);
            GRANT SELECT, INSERT ON app.parent, app.child TO alice;

            CREATE FUNCTION app.alice_ledger(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO ledger VALUES (current_user, (args->>'v')::int);   -- unqualified on purpose
                RETURN jsonb_build_object('user', current_user);
            END $$;
            CREATE FUNCTION app.alice_void(args jsonb) RETURNS void LANGUAGE plpgsql AS $$
            BEGIN INSERT INTO ledger VALUES (current_user, -1); END $$;
            -- child before parent: fine with a deferred foreign key, checked at the end
            CREATE FUNCTION app.alice_family(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.child VALUES ((args->>'id')::int, (args->>'parent')::int);
                IF (args->>'with_parent')::boolean THEN
                    INSERT INTO app.parent VALUES ((args->>'parent')::int);
                END IF;
                RETURN '{}';
            END $$;
            CREATE FUNCTION app.alice_event(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN PERFORM flow.emit('ping', args->>'key'); RETURN '{}'; END $$;
            ALTER FUNCTION app.alice_ledger(jsonb) OWNER TO alice;
            ALTER FUNCTION app.alice_void(jsonb) OWNER TO alice;
            ALTER FUNCTION app.alice_family(jsonb) OWNER TO alice;
            ALTER FUNCTION app.alice_event(jsonb) OWNER TO alice;
            -- mallory's SQL runner that also says which worker process ran it
            GRANT USAGE ON SCHEMA app TO mallory;
            CREATE FUNCTION app.mallory_sql(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                EXECUTE args->>'sql';
                RETURN jsonb_build_object('pid', pg_backend_pid());
            END $$;
            ALTER FUNCTION app.mallory_sql(jsonb) OWNER TO mallory;
        """)
        c.execute(EFFECTS + ENGINE_APP)   # (app.hello, for section 20)
    yield cluster
    cluster.stop()


def run_sql_as(pg, user, sql, max_attempts=1, **kw):
    """Define a flow.run_sql definition as `user`, enqueue `sql`, await it."""
    name = unique("sql")
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    pg.one(f"SELECT flow.define('{name}', 'flow.run_sql'::regproc, max_attempts => {max_attempts}{params})",
           user=user)
    run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('sql', %s::text))", name, sql, user=user)
    return run, pg.await_run(run, "30s", user=user)


def alice_runs(pg, handler, args="{}", **kw):
    name = unique("a")
    params = "".join(f", {k} => {v}" for k, v in kw.items())
    pg.one(f"SELECT flow.define('{name}', '{handler}'::regproc{params})", user="alice")
    run = pg.one(f"SELECT flow.enqueue('{name}', '{args}')", user="alice")
    return run, pg.await_run(run, "30s", user="alice")


def alice_counted_handler(pg):
    """A handler of alice's that counts its calls: its name, and the
    sequence whose last_value is the count."""
    calls = unique("calls")
    pg.all(f"""
        CREATE SEQUENCE app.{calls};
        ALTER SEQUENCE app.{calls} OWNER TO alice;
        CREATE FUNCTION app.{calls}_handler(args jsonb) RETURNS jsonb LANGUAGE sql
            AS $$ SELECT jsonb_build_object('call', nextval('app.{calls}')) $$;
        ALTER FUNCTION app.{calls}_handler(jsonb) OWNER TO alice;""")
    return f"app.{calls}_handler", f"app.{calls}"


def is_superuser(pg, role):
    return pg.one("SELECT rolsuper FROM pg_roles WHERE rolname = %s", role)


def error_of(pg, run):
    return pg.all("SELECT last_error_code, last_error_message FROM flow._commands WHERE run_id = %s"
                  " AND key = 'root'", run)[0]


# ---------------------------------------------------------------- 1. commit-time code

PWN = """
CREATE FUNCTION pg_temp.esc() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN EXECUTE 'ALTER ROLE mallory SUPERUSER'; RETURN NULL; END $f$;
CREATE TEMP TABLE pwn_t (x int);
CREATE CONSTRAINT TRIGGER esc AFTER INSERT ON pwn_t DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION pg_temp.esc();
INSERT INTO pwn_t VALUES (1)
"""


def test_a_deferred_trigger_runs_as_its_owner_inside_the_attempt(pg):
    run, (status, _, _) = run_sql_as(pg, "mallory", PWN)
    assert is_superuser(pg, "mallory") is False
    # it fired when the handler returned, as mallory, and failed her command alone
    assert status == "failed"
    assert error_of(pg, run)[0] == "42501"


def test_deferred_foreign_keys_work_and_a_violation_fails_only_its_command(pg):
    pg.one("SELECT flow.set_queue('role:alice', paused => true)", user="alice")
    try:
        name = unique("fam")
        pg.one(f"SELECT flow.define('{name}', 'app.alice_family'::regproc, max_attempts => 1)", user="alice")
        good = [pg.one(f"SELECT flow.enqueue('{name}', jsonb_build_object('id', {i}, 'parent', {i},"
                       " 'with_parent', true))", user="alice") for i in range(1, 21)]
        bad = pg.one(f"SELECT flow.enqueue('{name}', '{{\"id\": 100, \"parent\": 999, \"with_parent\": false}}')",
                     user="alice")
    finally:
        pg.one("SELECT flow.set_queue('role:alice', paused => false)", user="alice")
    for run in good:
        assert pg.await_run(run, user="alice")[0] == "succeeded"
    assert pg.await_run(bad, user="alice")[0] == "failed"
    assert error_of(pg, bad)[0] == "23503"
    # one attempt each: nobody was charged for the violation of another
    assert pg.one("SELECT max(attempts) FROM flow._commands c JOIN flow._run_rows r ON r.id = c.run_id"
                  " WHERE r.name = %s", name) == 1
    assert pg.one("SELECT count(*) FROM app.child") == 20


@pytest.mark.parametrize("sql", [
    "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
    "LISTEN flow_worker_channel",
])
def test_what_would_linger_in_the_workers_session_is_refused(pg, sql):
    run, (status, _, _) = run_sql_as(pg, "mallory", sql)
    assert status == "failed"
    code, message = error_of(pg, run)
    assert code == "0A000" and "WITH HOLD cursors or LISTEN" in message


def mallory_on_every_worker(pg, sql):
    """Run `sql` as mallory until it has run in every worker process; returns
    the definition name."""
    name = unique("m")
    pg.one(f"SELECT flow.define('{name}', 'app.mallory_sql'::regproc, max_attempts => 1)", user="mallory")
    workers = {r[0] for r in pg.all("SELECT pid FROM flow.workers")}
    seen = set()
    busy = unique("busy")
    pg.one(f"SELECT flow.define('{busy}', 'flow.run_sql'::regproc)")
    for i in range(40):
        # an idle engine hands single runs to its first idle worker: every
        # other round, keep a worker busy so that the run lands on another
        if i % 2:
            blocker = pg.one(f"SELECT flow.enqueue('{busy}', '{{\"sql\": \"SELECT pg_sleep(0.3)\"}}')")
            pg.wait_for("SELECT count(*) = 1 FROM flow.workers w JOIN flow._commands c ON c.id = w.command_id"
                        " WHERE c.run_id = %s", blocker, timeout=5)
        run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('sql', %s::text))", name, sql, user="mallory")
        status, result, _ = pg.await_run(run, user="mallory")
        assert status == "succeeded"
        seen.add(result["pid"])
        if seen >= workers:
            return name
    pytest.fail(f"mallory's SQL never reached every worker: {seen} of {workers}")


def test_session_leftovers_do_not_survive_the_attempt(pg):
    mallory_on_every_worker(pg, """
        PREPARE sneaky AS SELECT 1;
        PERFORM pg_advisory_lock(4242);
        SET work_mem = '77MB';
        CREATE TEMP TABLE void (x int);
        CREATE TEMP TABLE text (x int);
        CREATE TEMP TABLE jsonb (x int);
        CREATE TEMP TABLE ledger (who text, v int);
        GRANT ALL ON ledger TO PUBLIC;
        DECLARE left_open CURSOR FOR SELECT 42""".replace("PERFORM", "SELECT"))
    # the session advisory lock was released with each attempt
    assert pg.one("SELECT pg_try_advisory_lock(4242)") is True
    # mallory's temp tables named like types and like alice's table are gone from
    # every worker: alice's unqualified insert and her void handler use the real things
    for i in range(4):
        assert alice_runs(pg, "app.alice_ledger", f'{{"v": {i}}}')[1][0] == "succeeded"
        assert alice_runs(pg, "app.alice_void")[1][0] == "succeeded"
    assert pg.one("SELECT count(*) FROM public.ledger WHERE who = 'alice' AND v BETWEEN 0 AND 3") == 4
    # in every worker, the prepared statement and the setting are gone
    probe = mallory_on_every_worker(pg, """
        DO $d$ BEGIN
            IF current_setting('work_mem') = '77MB' THEN RAISE EXCEPTION 'setting leaked'; END IF;
            IF EXISTS (SELECT 1 FROM pg_prepared_statements) THEN RAISE EXCEPTION 'statement leaked'; END IF;
            IF EXISTS (SELECT 1 FROM pg_class WHERE relpersistence = 't') THEN RAISE EXCEPTION 'temp leaked'; END IF;
            IF EXISTS (SELECT 1 FROM pg_cursors) THEN RAISE EXCEPTION 'cursor leaked'; END IF;
        END $d$""")
    assert probe


def test_a_handlers_search_path_is_its_own_and_never_outlives_its_attempt(pg):
    """A handler starts with its owner's search_path (mallory sets none:
    `"$user"` alone) and may change it as its own (SET, set_config, RESET);
    whatever it did is gone with its attempt, failed or not: every worker's
    next handler starts with `"$user"` again, and the engine's own SQL (which
    pins its own path) keeps working."""
    mallory_on_every_worker(pg, """
        SET search_path = pg_temp, public;
        DO $d$ BEGIN
            IF current_setting('search_path') <> 'pg_temp, public' THEN RAISE EXCEPTION 'SET not seen'; END IF;
        END $d$""")
    mallory_on_every_worker(pg, "SELECT set_config('search_path', 'nowhere', false); RESET search_path")
    for _ in range(4):
        run, (status, _, _) = run_sql_as(pg, "mallory", """DO $d$ BEGIN
            PERFORM set_config('search_path', 'nowhere', false);
            IF current_setting('search_path') <> 'nowhere' THEN RAISE EXCEPTION 'set_config not seen'; END IF;
            RAISE EXCEPTION 'boom';
        END $d$""")
        assert status == "failed"
        assert error_of(pg, run)[1] == "boom"
    mallory_on_every_worker(pg, """
        DO $d$ BEGIN
            IF current_setting('search_path') <> '"$user"' THEN
                RAISE EXCEPTION 'search_path left behind: %', current_setting('search_path');
            END IF;
        END $d$""")
    for i in range(4):
        assert alice_runs(pg, "app.alice_ledger", f'{{"v": {600 + i}}}')[1][0] == "succeeded"
    assert pg.one("SELECT count(*) FROM public.ledger WHERE who = 'alice' AND v BETWEEN 600 AND 603") == 4


def test_a_temp_table_with_a_trigger_never_catches_another_roles_rows(pg):
    mallory_on_every_worker(pg, """
        CREATE TEMP TABLE ledger (who text, v int);
        GRANT ALL ON ledger TO PUBLIC;
        CREATE FUNCTION pg_temp.steal() RETURNS trigger LANGUAGE plpgsql AS $f$
        BEGIN RETURN NULL; END $f$;
        CREATE TRIGGER steal BEFORE INSERT ON ledger FOR EACH ROW EXECUTE FUNCTION pg_temp.steal()""")
    for _ in range(4):
        assert alice_runs(pg, "app.alice_ledger", '{"v": 500}')[1][0] == "succeeded"
    assert pg.one("SELECT count(*) FROM public.ledger WHERE v = 500") == 4


# ---------------------------------------------------------------- 2. who may start what

def test_internal_functions_are_not_callable_by_ordinary_roles(pg):
    """flow._* are the engine's own (lease tokens, settlements, locks, claims):
    an ordinary role may call none of them but the few that run in the
    caller's own context (sql/api.sql names them), so no role can mint a lease
    token, settle or claim past the public functions' checks."""
    callable_ = {r[0] for r in pg.all(
        "SELECT p.proname FROM pg_proc p WHERE p.pronamespace = 'flow'::regnamespace AND p.proname LIKE '\\_%'"
        " AND has_function_privilege('mallory', p.oid, 'EXECUTE')")}
    assert "_ticket" in callable_   # (runs in the caller's context: everyone's)
    assert callable_ <= {"_ticket", "_left_out", "_decide", "_worker_rows", "_held_rows", "_counters", "_args_misfit",
                         "_among", "_lane", "_span_ok"}
    # (other roles' commands: flow._worker_rows and flow._held_rows hide them)
    assert "_worker_states" not in callable_ and "_held_states" not in callable_
    for name in ("_lease_token", "_claim", "_lease", "_settle_batch", "_complete_many", "_lock_runs",
                 "_external_cursor_end", "_rate_admit", "_fire_schedules", "_schedule_due"):
        assert pg.one("SELECT count(*) FROM pg_proc p WHERE p.pronamespace = 'flow'::regnamespace"
                      " AND p.proname = %s", name) >= 1
        assert name not in callable_
    assert pg.sqlstate("SELECT flow._lease_token()", user="mallory") == "42501"


def test_run_sql_is_not_for_everyone_and_never_opened_to_others(pg):
    assert pg.one("SELECT has_function_privilege('bob', 'flow.run_sql(jsonb)', 'EXECUTE')") is False
    name = unique("dba")
    pg.one(f"SELECT flow.define('{name}', 'flow.run_sql'::regproc)")
    assert pg.sqlstate("SELECT flow.enqueue(%s, '{\"sql\": \"ALTER ROLE mallory SUPERUSER\"}')", name,
                       user="mallory") == "FL001"
    assert pg.sqlstate(f"SELECT flow.grant_definition('{name}', 'mallory')") == "42501"
    assert pg.sqlstate(f"SELECT flow.grant_definition('{name}', 'PUBLIC')") == "42501"
    # and a definition already open cannot be switched to run_sql
    open_ = unique("open")
    pg.one(f"SELECT flow.define('{open_}', 'flow.noop'::regproc)")
    pg.one(f"SELECT flow.grant_definition('{open_}', 'PUBLIC')")
    assert pg.sqlstate(f"SELECT flow.define('{open_}', 'flow.run_sql'::regproc)") == "42501"
    assert is_superuser(pg, "mallory") is False


def test_a_definition_is_its_owners_until_opened(pg):
    name = unique("mine")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_ledger'::regproc)", user="alice")
    for user in ("bob", "mallory"):
        assert pg.sqlstate(f"SELECT flow.enqueue('{name}', '{{\"v\": 1}}')", user=user) == "FL001"
    pg.one(f"SELECT flow.grant_definition('{name}', 'bob')", user="alice")
    run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"v\": 7}}')", user="bob")
    status, result, _ = pg.await_run(run, user="bob")
    assert status == "succeeded" and result == {"user": "alice"}
    assert pg.sqlstate(f"SELECT flow.enqueue('{name}', '{{\"v\": 1}}')", user="mallory") == "FL001"
    # names of other roles cannot be probed: unknown and foreign look alike
    assert pg.sqlstate("SELECT flow.enqueue('no_such_definition_at_all')", user="mallory") == "FL001"


def test_a_temporary_function_is_no_handler(pg):
    with pg.connect("mallory") as m:
        m.execute("CREATE FUNCTION pg_temp.h(args jsonb) RETURNS jsonb LANGUAGE sql AS 'SELECT args'")
        with pytest.raises(psycopg.Error) as caught:
            m.execute(f"SELECT flow.define('{unique('tmp')}', 'pg_temp.h(jsonb)'::regprocedure)")
        assert caught.value.sqlstate == "FL008"


# ---------------------------------------------------------------- 4. planted objects

def test_the_engines_sql_ignores_objects_planted_in_public(pg):
    pg.all("GRANT CREATE ON SCHEMA public TO mallory")
    try:
        with pg.connect("mallory") as m:
            m.execute("""
                CREATE FUNCTION public.esc() RETURNS void LANGUAGE plpgsql AS $f$
                BEGIN
                    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
                        EXECUTE 'ALTER ROLE mallory SUPERUSER';
                    END IF;
                END $f$;
                CREATE FUNCTION public.to_jsonb(flow.context) RETURNS jsonb LANGUAGE plpgsql AS $f$
                BEGIN PERFORM public.esc(); RETURN '{}'; END $f$;
                CREATE FUNCTION public.make_interval(secs double precision) RETURNS interval LANGUAGE plpgsql AS $f$
                BEGIN PERFORM public.esc(); RETURN interval '1 s'; END $f$;
                CREATE FUNCTION public.eq_oid_regtype(oid, regtype) RETURNS boolean LANGUAGE plpgsql AS $f$
                BEGIN PERFORM public.esc(); RETURN $1 = $2::oid; END $f$;
                CREATE OPERATOR public.= (LEFTARG = oid, RIGHTARG = regtype, FUNCTION = public.eq_oid_regtype);
                CREATE FUNCTION public.jsonb_populate_record(anyelement, jsonb) RETURNS anyelement
                    LANGUAGE plpgsql AS $f$ BEGIN PERFORM public.esc(); RETURN $1; END $f$;
            """)
        # fresh worker sessions prepare every plan again
        pg.all("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'flow worker'")
        pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")
        name = unique("ctx")
        pg.all("CREATE FUNCTION app.ctx_handler(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS"
               " $$ BEGIN IF ctx.attempt = 1 THEN PERFORM flow.retry_after('10 ms'); END IF;"
               " RETURN jsonb_build_object('attempt', ctx.attempt); END $$")
        pg.one(f"SELECT flow.define('{name}', 'app.ctx_handler(jsonb, flow.context)'::regprocedure)")
        run = pg.one(f"SELECT flow.enqueue('{name}')")
        assert pg.await_run(run)[:2] == ("succeeded", {"attempt": 2})
        assert alice_runs(pg, "app.alice_void")[1][0] == "succeeded"
        assert is_superuser(pg, "mallory") is False
    finally:
        pg.all("REVOKE CREATE ON SCHEMA public FROM mallory")


# ---------------------------------------------------------------- 5. races for a name

def test_no_role_can_take_over_a_definition_name(pg):
    name = unique("send_welcome")
    holder = pg.connect("mallory", autocommit=False)
    holder.execute("SELECT flow.set_queue(%s)", (name + "_trap",))          # holds the queue row
    outcome = {}

    def mallory_defines():
        try:
            with pg.connect("mallory") as m2:
                m2.execute(f"SELECT flow.define('{name}', 'flow.run_sql'::regproc, queue => '{name}_trap')")
            outcome["mallory"] = "ok"
        except psycopg.Error as e:
            outcome["mallory"] = e.sqlstate

    def alice_defines():
        try:
            pg.one(f"SELECT flow.define('{name}', 'app.alice_ledger'::regproc)", user="alice")
            outcome["alice"] = "ok"
        except psycopg.Error as e:
            outcome["alice"] = e.sqlstate

    waiting = "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s"
    t1 = threading.Thread(target=mallory_defines)
    t1.start()
    poll(lambda: "mallory" in outcome or pg.one(waiting, "%flow.run_sql%"), what="mallory's define to wait")
    t2 = threading.Thread(target=alice_defines)
    t2.start()
    poll(lambda: "alice" in outcome or pg.one(waiting, "%app.alice_ledger%"), what="alice's define to wait")
    holder.rollback()
    holder.close()
    t1.join(10)
    t2.join(10)
    rows = pg.all("SELECT owner::text, handler::text FROM flow._definitions WHERE name = %s", name)
    # whoever owns the name, its handler is that role's choice
    assert rows in ([("mallory", "flow.run_sql(jsonb)")], [("alice", "app.alice_ledger(jsonb)")])
    if rows[0][0] == "mallory":
        assert outcome == {"mallory": "ok", "alice": "FL011"}
    # nor can a newer version be slipped under another role's name
    mine = unique("versioned")
    pg.one(f"SELECT flow.define('{mine}', 'app.alice_ledger'::regproc)", user="alice")
    assert pg.sqlstate(f"SELECT flow.define('{mine}', 'flow.run_sql'::regproc, version => 2)",
                       user="mallory") == "FL011"


# ---------------------------------------------------------------- 6. out-of-range values

@pytest.mark.parametrize("call, code", [
    ("flow.define('{n}', 'flow.noop'::regproc, timeout => '300000 years')", "FL015"),
    ("flow.define('{n}', 'flow.noop'::regproc, backoff => '300000 years', backoff_max => '300000 years')", "FL015"),
    ("flow.define('{n}', 'flow.noop'::regproc, backoff_max => '300000 years')", "FL015"),
    ("flow.define('{n}', 'flow.noop'::regproc, max_elapsed => '300000 years')", "FL015"),
    ("flow.enqueue('{d}', start_after => '300000 years')", "FL005"),
    ("flow.enqueue('{d}', run_at => 'infinity')", "FL005"),
    ("flow.enqueue('{d}', run_at => '200000-01-01')", "FL005"),
    ("flow.enqueue('{d}', deadline => '300000 years')", "FL005"),
    ("flow.await(gen_random_uuid(), '300000 years')", "FL005"),
])
def test_huge_intervals_and_infinite_times_are_refused(pg, call, code):
    d = unique("bounded")
    pg.one(f"SELECT flow.define('{d}', 'flow.noop'::regproc)", user="alice")
    before = pg.one("SELECT count(*) FROM flow._definitions") , pg.one("SELECT count(*) FROM flow._run_rows")
    assert pg.sqlstate("SELECT " + call.format(n=unique("n"), d=d), user="alice") == code
    assert (pg.one("SELECT count(*) FROM flow._definitions"), pg.one("SELECT count(*) FROM flow._run_rows")) == before


def test_a_huge_retry_after_fails_its_command_and_nothing_else(pg):
    run, (status, _, _) = run_sql_as(pg, "mallory", "SELECT flow.retry_after('292260 years')", max_attempts=5)
    assert status == "failed"
    assert error_of(pg, run)[0] == "invalid_retry_after"
    assert alice_runs(pg, "app.alice_void")[1][0] == "succeeded"


# ---------------------------------------------------------------- 7. queues have owners

def test_queues_belong_to_their_creator(pg):
    # nobody but a superuser manages the shared default queue
    assert pg.sqlstate("SELECT flow.set_queue('default', paused => true)", user="mallory") == "FL011"
    assert pg.one("SELECT paused FROM flow._queues WHERE name = 'default'") is False
    # alice's limited queue: mallory can neither pause nor flood it
    q = unique("alice_q")
    pg.one(f"SELECT flow.set_queue('{q}', concurrency => 1)", user="alice")
    assert pg.sqlstate(f"SELECT flow.set_queue('{q}', paused => true)", user="mallory") == "FL011"
    with pg.connect("mallory") as m:
        m.execute(f"SELECT flow.define('{unique('flood')}', 'flow.run_sql'::regproc)")
    flood = pg.one("SELECT name FROM flow._definitions WHERE owner = 'mallory'::regrole ORDER BY created_at DESC"
                   " LIMIT 1")
    assert pg.sqlstate(f"SELECT flow.enqueue('{flood}', '{{\"sql\": \"SELECT 1\"}}', queue => '{q}')",
                       user="mallory") == "FL011"
    assert pg.sqlstate(f"SELECT flow.define('{unique('on_q')}', 'flow.run_sql'::regproc, queue => '{q}')",
                       user="mallory") == "FL011"
    # a queue mallory created first is hers; alice uses it only when granted
    mq = unique("squat")
    pg.one(f"SELECT flow.set_queue('{mq}', paused => true)", user="mallory")
    assert pg.sqlstate(f"SELECT flow.define('{unique('x')}', 'app.alice_void'::regproc, queue => '{mq}')",
                       user="alice") == "FL011"
    pg.one(f"SELECT flow.grant_queue('{q}', 'bob')", user="alice")
    assert pg.one(f"SELECT 'bob' = ANY (users::text[]) FROM flow.queues WHERE name = '{q}'", user="alice") is True
    # mallory sees neither alice's queue nor anyone's counts
    assert pg.one(f"SELECT count(*) FROM flow.queues WHERE name = '{q}'", user="mallory") == 0


def test_a_queue_is_dropped_by_its_owner_once_nothing_uses_it(pg):
    q = unique("drop_q")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    assert pg.sqlstate(f"SELECT flow.drop_queue('{q}')", user="mallory") == "FL011"
    pg.one("SELECT flow.set_queue('default')")   # it exists once used
    assert pg.sqlstate("SELECT flow.drop_queue('default')", user="mallory") == "FL011"
    name = unique("on_drop_q")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_void'::regproc, queue => '{q}')", user="alice")
    assert pg.sqlstate(f"SELECT flow.drop_queue('{q}')", user="alice") == "2BP01"   # a definition uses it
    other = unique("other_q")
    pg.one(f"SELECT flow.set_queue('{other}', paused => true)", user="alice")
    run = pg.one(f"SELECT flow.enqueue('{name}', queue => '{other}')", user="alice")
    assert pg.sqlstate(f"SELECT flow.drop_queue('{other}')", user="alice") == "2BP01"   # a command waits in it
    pg.one(f"SELECT flow.cancel('{run}')", user="alice")
    assert pg.one(f"SELECT flow.drop_queue('{other}')", user="alice") is True
    assert pg.one(f"SELECT flow.drop_queue('{other}')", user="alice") is False
    assert pg.one(f"SELECT count(*) FROM flow._queues WHERE name = '{other}'") == 0


# ---------------------------------------------------------------- 9. other roles' events

def test_a_workflow_cannot_read_another_roles_events(pg):
    key = unique("card")
    pg.one("SELECT flow.emit('card', %s, '{\"number\": \"4111 1111 1111 1111\"}')", key, user="alice")
    pg.all("CREATE FUNCTION app.spy_root(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$ BEGIN"
           " PERFORM flow.spawn(args->>'child', '{}', key => 'spy', waits => array[flow.wait('card', args->>'key')],"
           " within => '1 second'); RETURN '{}'; END $$")
    pg.all("CREATE FUNCTION app.spy_child(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$"
           " BEGIN RETURN jsonb_build_object('inputs', ctx.inputs, 'timed_out', ctx.wait_timed_out); END $$")
    pg.all("GRANT USAGE ON SCHEMA app TO mallory")
    pg.all("ALTER FUNCTION app.spy_root(jsonb) OWNER TO mallory")
    pg.all("ALTER FUNCTION app.spy_child(jsonb, flow.context) OWNER TO mallory")
    root, child = unique("spy_root"), unique("spy_child")
    pg.one(f"SELECT flow.define('{child}', 'app.spy_child(jsonb, flow.context)'::regprocedure)", user="mallory")
    pg.one(f"SELECT flow.define('{root}', 'app.spy_root'::regproc)", user="mallory")
    run = pg.one(f"SELECT flow.enqueue('{root}', jsonb_build_object('child', '{child}', 'key', '{key}'))",
                 user="mallory")
    assert pg.await_run(run, user="mallory")[0] == "succeeded"
    result = pg.one("SELECT result FROM flow._commands WHERE run_id = %s AND key = 'spy'", run)
    assert result == {"inputs": [], "timed_out": True}
    assert "4111" not in str(pg.all("SELECT * FROM flow.events", user="mallory"))


# ---------------------------------------------------------------- 10, 11. stalls and leaks

def test_an_open_set_queue_transaction_holds_up_only_its_queue(pg):
    mine, other = unique("held"), unique("free")
    pg.one(f"SELECT flow.set_queue('{mine}', concurrency => 1)", user="alice")
    pg.one(f"SELECT flow.set_queue('{other}', concurrency => 2)", user="bob")
    pg.all("CREATE FUNCTION app.bob_void(args jsonb) RETURNS void LANGUAGE sql AS 'SELECT'")
    pg.all("ALTER FUNCTION app.bob_void(jsonb) OWNER TO bob")
    b = unique("b")
    pg.one(f"SELECT flow.define('{b}', 'app.bob_void'::regproc, queue => '{other}')", user="bob")
    a = unique("a")
    pg.one(f"SELECT flow.define('{a}', 'app.alice_void'::regproc, queue => '{mine}')", user="alice")
    alice_run = pg.one(f"SELECT flow.enqueue('{a}')", user="alice")
    blocker = pg.connect("alice", autocommit=False)
    try:
        blocker.execute(f"SELECT flow.set_queue('{mine}', concurrency => 1)")
        started = time.time()
        runs = [pg.one(f"SELECT flow.enqueue('{b}')", user="bob") for _ in range(5)]
        for run in runs:
            assert pg.await_run(run, "10s", user="bob")[0] == "succeeded"
        assert time.time() - started < 8
    finally:
        blocker.rollback()
        blocker.close()
    assert pg.await_run(alice_run, user="alice")[0] == "succeeded"


def test_an_open_enqueue_into_a_granted_queue_holds_up_nothing(pg):
    """bob may enqueue into alice's limited queue; leaving that transaction
    open must stall neither the queue's claims nor alice's flow.set_queue."""
    q = unique("lent")
    pg.one(f"SELECT flow.set_queue('{q}', concurrency => 2)", user="alice")
    pg.one(f"SELECT flow.grant_queue('{q}', 'bob')", user="alice")
    pg.all("CREATE OR REPLACE FUNCTION app.bob_void(args jsonb) RETURNS void LANGUAGE sql AS 'SELECT'")
    pg.all("ALTER FUNCTION app.bob_void(jsonb) OWNER TO bob")
    b, a = unique("b"), unique("a")
    pg.one(f"SELECT flow.define('{b}', 'app.bob_void'::regproc)", user="bob")
    pg.one(f"SELECT flow.define('{a}', 'app.alice_void'::regproc, queue => '{q}')", user="alice")
    holder = pg.connect("bob", autocommit=False)
    try:
        holder.execute(f"SELECT flow.enqueue('{b}', queue => '{q}')")
        started = time.time()
        runs = [pg.one(f"SELECT flow.enqueue('{a}')", user="alice") for _ in range(5)]
        for run in runs:
            assert pg.await_run(run, "10s", user="alice")[0] == "succeeded"
        pg.one(f"SELECT flow.set_queue('{q}', concurrency => 3)", user="alice")
        assert time.time() - started < 8
    finally:
        holder.rollback()
        holder.close()
    # and a queue someone is enqueueing into is not dropped under them
    assert pg.sqlstate(f"SELECT flow.drop_queue('{q}')", user="alice") == "2BP01"


def test_another_roles_lease_is_not_found_at_once(pg):
    name = unique("ext")
    pg.one(f"SELECT flow.define('{name}', NULL)", user="alice")
    pg.one(f"SELECT flow.enqueue('{name}')", user="alice")
    with pg.connect("alice") as a:
        cmd, token = a.execute(f"SELECT command_id, lease_token FROM flow.claim(array['{name}'], 'w', 1)").fetchone()
    holder = pg.connect("alice", autocommit=False)
    try:
        holder.execute("SELECT flow.heartbeat(%s, %s)", (cmd, token))       # holds the run's lock
        started = time.time()
        assert pg.sqlstate("SELECT flow.heartbeat(%s, gen_random_uuid())", cmd, user="mallory") == "FL014"
        assert pg.sqlstate("SELECT flow.complete(%s, gen_random_uuid())", cmd, user="mallory") == "FL014"
        assert time.time() - started < 1.0
    finally:
        holder.rollback()
        holder.close()


def test_advisory_locks_cannot_stall_another_roles_events(pg):
    key = unique("k")
    with pg.connect("mallory") as m:
        m.execute("SELECT pg_advisory_lock(hashtextextended('flow.event:ping:' || %s, 0))", (key,))
        for k1, k2 in [(0, 0), (1, 1)]:
            m.execute("SELECT pg_advisory_lock(%s, %s)", (k1, k2))
        started = time.time()
        assert pg.one("SELECT flow.emit('ping', %s) > 0", key, user="alice") is True
        run, (status, _, _) = alice_runs(pg, "app.alice_event", f'{{"key": "{key}"}}')
        assert status == "succeeded"
        assert time.time() - started < 10


def test_an_open_emit_holds_up_no_other_roles_waits(pg):
    """mallory emits ('ping', key) and leaves her transaction open: alice's
    workflow can still create a wait on that key, and alice's emit of it
    still satisfies the wait, at once."""
    pg.all("""CREATE FUNCTION app.alice_waits(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$ BEGIN
                  PERFORM flow.spawn(args->>'child', '{}', key => 'w',
                                     waits => array[flow.wait('ping', args->>'key')], within => '30 s');
                  RETURN '{}'; END $$;
              CREATE FUNCTION app.alice_inputs(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
                  BEGIN RETURN jsonb_build_object('inputs', ctx.inputs, 'timed_out', ctx.wait_timed_out); END $$;
              ALTER FUNCTION app.alice_waits(jsonb) OWNER TO alice;
              ALTER FUNCTION app.alice_inputs(jsonb, flow.context) OWNER TO alice""")
    root, child = unique("waits"), unique("inputs")
    pg.one(f"SELECT flow.define('{child}', 'app.alice_inputs(jsonb, flow.context)'::regprocedure)", user="alice")
    pg.one(f"SELECT flow.define('{root}', 'app.alice_waits'::regproc)", user="alice")
    key = unique("k")
    holder = pg.connect("mallory", autocommit=False)
    try:
        holder.execute("SELECT flow.emit('ping', %s, '{\"from\": \"mallory\"}')", (key,))
        started = time.time()
        run = pg.one(f"SELECT flow.enqueue('{root}', jsonb_build_object('child', '{child}', 'key', '{key}'))",
                     user="alice")
        pg.wait_for("SELECT count(*) = 1 FROM flow._commands WHERE run_id = %s AND key = 'w'"
                    " AND status = 'waiting'", run, timeout=10)
        pg.one("SELECT flow.emit('ping', %s, '{\"from\": \"alice\"}')", key, user="alice")
        assert pg.await_run(run, "10s", user="alice")[0] == "succeeded"
        assert time.time() - started < 10
        result = pg.one("SELECT result FROM flow._commands WHERE run_id = %s AND key = 'w'", run)
        assert result["timed_out"] is False
        assert [i["payload"] for i in result["inputs"]] == [{"from": "alice"}]
    finally:
        holder.rollback()
        holder.close()


def test_the_workers_view_names_only_your_own_commands(pg):
    name = unique("sleepy")
    pg.one(f"SELECT flow.define('{name}', 'flow.run_sql'::regproc)", user="mallory")
    run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"sql\": \"SELECT pg_sleep(1.5)\"}}')", user="mallory")
    pg.wait_for("SELECT count(*) = 1 FROM flow.workers WHERE command_id IS NOT NULL", user="mallory")
    assert pg.one("SELECT count(*) FROM flow.workers WHERE command_id IS NOT NULL", user="alice") == 0
    assert pg.await_run(run, user="mallory")[0] == "succeeded"


def test_database_and_role_settings_do_not_change_the_workers(pg):
    pg.all("ALTER DATABASE postgres SET default_transaction_isolation = 'serializable'")
    pg.all("ALTER DATABASE postgres SET lock_timeout = '1ms'")
    pg.all("ALTER DATABASE postgres SET session_replication_role = 'replica'")
    pg.all("ALTER DATABASE postgres SET default_transaction_read_only = on")
    try:
        # workers that start now connect under these settings
        old = pg.worker_pids()
        pg.all("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'flow worker'")
        pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL AND pid <> ALL (%s)", old)
        with pg.connect() as c:
            assert c.execute("SHOW default_transaction_isolation").fetchone()[0] == "serializable"
    finally:
        with pg.connect() as c:
            c.execute("SET default_transaction_read_only = off")
            c.execute("ALTER DATABASE postgres RESET ALL")
    name = unique("fam")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_family'::regproc, max_attempts => 1)")
    ok = pg.one(f"SELECT flow.enqueue('{name}', '{{\"id\": 500, \"parent\": 500, \"with_parent\": true}}')")
    bad = pg.one(f"SELECT flow.enqueue('{name}', '{{\"id\": 501, \"parent\": 9999, \"with_parent\": false}}')")
    # read-only and serializable defaults did not stop the workers' claims and settlements
    assert pg.await_run(ok)[0] == "succeeded"
    # the foreign key is still enforced in the worker (no 'replica' replication role)
    assert pg.await_run(bad)[0] == "failed" and error_of(pg, bad)[0] == "23503"
    assert pg.one("SELECT count(*) FROM app.child WHERE id = 501") == 0


# ---------------------------------------------------------------- 6. containment

def set_faults(pg, value):
    pg.configure("flow.fault_points", value, settle=0.3)


def test_an_engine_error_charges_no_command_that_did_not_cause_it(pg):
    pids = sorted(pg.worker_pids())
    name = unique("contained")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_void'::regproc, max_attempts => 1)", user="alice")
    pg.one("SELECT flow.set_queue('role:alice', paused => true)", user="alice")
    runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[30]))", user="alice")
    # every worker process fails the first settlement of successes it tries
    set_faults(pg, "settle_success:error@1")
    try:
        pg.one("SELECT flow.set_queue('role:alice', paused => false)", user="alice")
        for run in runs:
            assert pg.await_run(run, user="alice")[0] == "succeeded"
    finally:
        set_faults(pg, "")
    # nobody was charged for the failed chunk (its attempts that had started
    # are counted as voided), and no worker exited
    assert pg.all("SELECT DISTINCT a.outcome, a.error_code FROM flow.attempts a JOIN flow._run_rows r"
                  " ON r.id = a.run_id WHERE r.name = %s AND a.outcome <> 'succeeded'", name) in \
        ([], [("voided", "engine_error")])
    assert sorted(pg.worker_pids()) == pids
    assert "fault injected at settle_success" in pg.log()


def test_a_command_that_breaks_the_engine_fails_alone_with_its_error(pg):
    pids = sorted(pg.worker_pids())
    name = unique("poison")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_void'::regproc, max_attempts => 2, backoff => '10 ms')",
           user="alice")
    set_faults(pg, "settle_success:error")
    try:
        run = pg.one(f"SELECT flow.enqueue('{name}')", user="alice")
        assert pg.await_run(run, user="alice")[0] == "failed"
    finally:
        set_faults(pg, "")
    status, attempts, code, message = pg.all(
        "SELECT status, attempts, last_error_code, last_error_message FROM flow._commands WHERE run_id = %s", run)[0]
    # (each attempt that broke the engine in a shared chunk is voided, the
    # culprit's own attempts alone are charged)
    charged = pg.one("SELECT count(*) FROM flow._attempts a JOIN flow._commands c ON c.id = a.command_id"
                     " WHERE c.run_id = %s AND a.outcome <> 'voided'", run)
    assert (status, charged, code) == ("failed", 2, "engine_error")
    assert attempts >= charged
    assert "fault injected at settle_success" in message
    assert sorted(pg.worker_pids()) == pids
    assert alice_runs(pg, "app.alice_void")[1][0] == "succeeded"


def test_a_handler_that_swallows_its_timeout_is_stopped(pg):
    pg.all("""CREATE FUNCTION app.stubborn(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
              BEGIN
                  LOOP
                      BEGIN PERFORM pg_sleep(10); EXCEPTION WHEN query_canceled THEN NULL; END;
                  END LOOP;
              END $$""")
    pg.all("ALTER FUNCTION app.stubborn(jsonb) OWNER TO alice")
    started = time.time()
    run, (status, _, _) = alice_runs(pg, "app.stubborn", timeout="'300 ms'", max_attempts=2)
    assert status == "failed"
    outcomes = [r[0] for r in pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s ORDER BY attempt", run)]
    assert outcomes == ["interrupted", "interrupted"]
    assert time.time() - started < 20
    assert "ran past its deadline and ignored its cancel" in pg.log()
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")
    assert alice_runs(pg, "app.alice_void")[1][0] == "succeeded"


def restart_workers(pg):
    old = set(pg.worker_pids())
    pg.all("SELECT pg_terminate_backend(pid) FROM flow.workers WHERE pid IS NOT NULL")
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL AND pid <> ALL (%s)", list(old))


def warm_workers(pg):
    """Fresh workers that have seen only fast handlers: they claim whole
    batches, so what is enqueued into a paused queue runs in one batch."""
    restart_workers(pg)
    warm = unique("warm")
    pg.one(f"SELECT flow.define('{warm}', 'app.alice_void'::regproc)", user="alice")
    for _ in range(3):
        for run in pg.one(f"SELECT flow.enqueue_many('{warm}', array_fill('{{}}'::jsonb, array[50]))", user="alice"):
            pg.await_run(run, "30s", user="alice")


def test_set_constraints_in_one_handler_does_not_reach_the_next(pg):
    """mallory's handler makes every constraint immediate; alice's handler,
    next in the same batch, still gets her deferred foreign key checked at the
    end of her attempt (the worker commits between them)."""
    q = unique("sc")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    pg.one(f"SELECT flow.grant_queue('{q}', 'mallory')", user="alice")
    m, a = unique("m"), unique("a")
    pg.one(f"SELECT flow.define('{m}', 'app.mallory_sql'::regproc, queue => '{q}', max_attempts => 1)",
           user="mallory")
    pg.one(f"SELECT flow.define('{a}', 'app.alice_family'::regproc, queue => '{q}', max_attempts => 1)",
           user="alice")
    warm_workers(pg)
    first = pg.one(f"SELECT flow.enqueue('{m}', '{{\"sql\": \"SET CONSTRAINTS ALL IMMEDIATE\"}}')",
                   user="mallory")
    runs = [pg.one(f"SELECT flow.enqueue('{a}', jsonb_build_object('id', 7100 + {i}, 'parent', 7100 + {i},"
                   " 'with_parent', true))", user="alice") for i in range(5)]
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)", user="alice")
    assert pg.await_run(first, "30s", user="mallory")[0] == "succeeded"
    for run in runs:
        assert pg.await_run(run, "30s", user="alice")[0] == "succeeded"


def test_a_stopped_worker_charges_only_the_attempt_it_was_in(pg):
    """A handler that swallows its timeout gets its worker stopped: only its
    attempt is charged; the other commands of the queue, whoever owns them,
    run once each (max_attempts 1). (A handler no worker has run yet is
    claimed alone, so the stopped worker held nothing else: see
    test_crash.py for what a dead worker's batch gives back.)"""
    pg.all("""CREATE OR REPLACE FUNCTION app.stubborn2(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
              BEGIN
                  LOOP
                      BEGIN PERFORM pg_sleep(10); EXCEPTION WHEN query_canceled THEN NULL; END;
                  END LOOP;
              END $$""")
    pg.all("ALTER FUNCTION app.stubborn2(jsonb) OWNER TO mallory")
    q = unique("shared")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    pg.one(f"SELECT flow.grant_queue('{q}', 'mallory')", user="alice")
    bad, good = unique("stub"), unique("good")
    pg.one(f"SELECT flow.define('{bad}', 'app.stubborn2'::regproc, queue => '{q}', timeout => '300 ms',"
           " max_attempts => 1)", user="mallory")
    pg.all("""CREATE FUNCTION app.alice_quiet(args jsonb) RETURNS void LANGUAGE plpgsql AS $$
              BEGIN INSERT INTO ledger VALUES (current_user, -2); END $$""")
    pg.all("ALTER FUNCTION app.alice_quiet(jsonb) OWNER TO alice")
    pg.one(f"SELECT flow.define('{good}', 'app.alice_quiet'::regproc, queue => '{q}', max_attempts => 1)",
           user="alice")
    stubborn = pg.one(f"SELECT flow.enqueue('{bad}')", user="mallory")
    runs = pg.one(f"SELECT flow.enqueue_many('{good}', array_fill('{{}}'::jsonb, array[30]))", user="alice")
    warm_workers(pg)
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)", user="alice")
    assert pg.await_run(stubborn, "30s", user="mallory")[0] == "failed"
    assert [r[0] for r in pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s", stubborn,
                                 user="mallory")] == ["interrupted"]
    for run in runs:
        assert pg.await_run(run, "30s", user="alice")[0] == "succeeded"
    outcomes = pg.all("SELECT outcome, count(*) FROM flow.attempts WHERE run_id = ANY (%s) GROUP BY 1",
                      runs, user="alice")
    assert outcomes == [("succeeded", 30)]
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")


def test_a_terminated_worker_hands_back_what_it_had_not_started(pg):
    """pg_terminate_backend of a worker charges the attempt it was in, and
    nothing else it had claimed."""
    q = unique("term")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    slow, fast = unique("slow"), unique("fast")
    pg.all("""CREATE OR REPLACE FUNCTION app.alice_nap(args jsonb) RETURNS jsonb LANGUAGE sql AS
              $$ SELECT jsonb_build_object('slept', pg_sleep(1)::text) $$""")
    pg.all("ALTER FUNCTION app.alice_nap(jsonb) OWNER TO alice")
    pg.one(f"SELECT flow.define('{slow}', 'app.alice_nap'::regproc, queue => '{q}', max_attempts => 2)",
           user="alice")
    pg.one(f"SELECT flow.define('{fast}', 'app.alice_void'::regproc, queue => '{q}', max_attempts => 1)",
           user="alice")
    first = pg.one(f"SELECT flow.enqueue('{slow}')", user="alice")
    runs = pg.one(f"SELECT flow.enqueue_many('{fast}', array_fill('{{}}'::jsonb, array[20]))", user="alice")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)", user="alice")
    running = ("SELECT w.pid FROM flow.workers w JOIN flow._commands c ON c.id = w.command_id"
               " WHERE c.run_id = %s")
    pg.wait_for(running, first)
    pid = pg.one(running, first)
    pg.one("SELECT pg_terminate_backend(%s)", pid)
    assert pg.await_run(first, "30s", user="alice")[0] == "succeeded"
    assert [r[0] for r in pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s ORDER BY attempt", first,
                                 user="alice")] == ["interrupted", "succeeded"]
    for run in runs:
        assert pg.await_run(run, "30s", user="alice")[0] == "succeeded"
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")


def test_one_role_cannot_flood_the_engine_with_queues(pg):
    pg.all("ALTER SYSTEM SET flow.max_queues_per_role = 5")
    pg.all("SELECT pg_reload_conf()")
    try:
        owned = pg.one("SELECT count(*) FROM flow._queues WHERE owner = 'bob'::regrole")
        for _ in range(5 - owned):
            pg.one(f"SELECT flow.set_queue('{unique('bq')}', paused => true)", user="bob")
        assert pg.sqlstate(f"SELECT flow.set_queue('{unique('bq')}')", user="bob") == "FL018"
        # superusers and the shared default queue are not counted against anyone
        pg.one(f"SELECT flow.set_queue('{unique('sq')}')")
    finally:
        pg.all("ALTER SYSTEM RESET flow.max_queues_per_role")
        pg.all("SELECT pg_reload_conf()")


# ---------------------------------------------------------------- 10. one role's backlog

def test_one_roles_backlog_does_not_hold_up_another_role(pg):
    flood = unique("flood")
    pg.one(f"SELECT flow.define('{flood}', 'flow.run_sql'::regproc)", user="mallory")
    pg.one(f"SELECT flow.enqueue_many('{flood}', array_fill('{{\"sql\": \"SELECT pg_sleep(0.005)\"}}'::jsonb,"
           " array[3000]))", user="mallory")
    started = time.time()
    run, (status, _, _) = alice_runs(pg, "app.alice_void")
    assert status == "succeeded"
    # alice's command ran in her own queue, long before mallory's backlog drained
    assert time.time() - started < 5
    assert pg.one("SELECT queue FROM flow._commands WHERE run_id = %s", run) == "role:alice"
    assert pg.one("SELECT count(*) FROM flow._commands c JOIN flow._definitions d ON d.name = c.name"
                  " WHERE d.name = %s AND c.status = 'pending'", flood) > 1000
    # nor can mallory take alice's own queue name
    assert pg.sqlstate("SELECT flow.set_queue('role:alice2')", user="mallory") == "FL011"
    pg.all(f"SELECT flow.cancel(r.id) FROM flow.runs r WHERE r.name = '{flood}' AND r.status = 'running'")


def test_drop_role_refuses_to_leave_flow_objects_without_an_owner(pg):
    pg.all("CREATE ROLE temp_owner LOGIN; CREATE ROLE heir LOGIN")
    name = unique("orphan")
    pg.one(f"SELECT flow.define('{name}', NULL)", user="temp_owner")
    run = pg.one(f"SELECT flow.enqueue('{name}')", user="temp_owner")
    assert pg.sqlstate("DROP ROLE temp_owner") == "2BP01"
    assert pg.sqlstate("DROP OWNED BY temp_owner") == "2BP01"
    # from another database, where flow's hook cannot see its tables,
    # PostgreSQL's own dependency check refuses it (flow._mark_owner)
    pg.all("CREATE DATABASE elsewhere")
    try:
        with psycopg.connect(pg.conninfo().replace("dbname=postgres", "dbname=elsewhere"),
                             autocommit=True) as other:
            with pytest.raises(psycopg.errors.DependentObjectsStillExist):
                other.execute("DROP ROLE temp_owner")
    finally:
        pg.all("DROP DATABASE elsewhere")
    pg.all("REASSIGN OWNED BY temp_owner TO heir")
    pg.all("DROP ROLE temp_owner")
    assert pg.one("SELECT owner::text FROM flow._definitions WHERE name = %s", name) == "heir"
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = %s", run, user="heir") == 1


def test_drop_role_refuses_while_the_role_has_unfinished_runs_only(pg):
    """A role that owns no definition or queue, only runs it started with
    another role's definition, is kept while one of them is unfinished (runs
    are not indexed by owner: the check reads the runs table)."""
    pg.all("CREATE ROLE starter_only LOGIN")
    name = unique("lent")
    pg.one(f"SELECT flow.define('{name}', NULL)")
    pg.one(f"SELECT flow.grant_definition('{name}', 'starter_only')")
    run = pg.one(f"SELECT flow.enqueue('{name}')", user="starter_only")
    assert pg.sqlstate("DROP ROLE starter_only") == "2BP01"
    assert pg.one("SELECT flow.cancel(%s)", run, user="starter_only") is True
    pg.all("DROP ROLE starter_only")
    assert pg.one("SELECT status::text FROM flow._run_rows WHERE id = %s", run) == "cancelled"


def test_a_settlement_is_retried_past_a_transient_error(pg):
    before = dict(pg.all("SELECT name, value FROM flow.stats"))
    name = unique("transient")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_void'::regproc, max_attempts => 1)", user="alice")
    set_faults(pg, "settle_success:transient@1")
    try:
        runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[10]))", user="alice")
        for run in runs:
            assert pg.await_run(run, user="alice")[0] == "succeeded"
    finally:
        set_faults(pg, "")
    after = dict(pg.all("SELECT name, value FROM flow.stats"))
    # retried in place (leased), or the held chunk contained (its attempts
    # voided: counted, not charged): nothing handed back, nobody charged twice
    assert after["handed_back"] == before["handed_back"]
    assert pg.one("SELECT max(c.attempts - (SELECT count(*) FROM flow._attempts a WHERE a.command_id = c.id"
                  " AND a.outcome = 'voided')) FROM flow._commands c JOIN flow._run_rows r ON r.id = c.run_id"
                  " WHERE r.name = %s", name) == 1


def test_a_settlement_rejected_as_invalid_is_an_invalid_decision(pg):
    name = unique("invalid")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_void'::regproc, max_attempts => 3)", user="alice")
    set_faults(pg, "settle_success:invalid")
    try:
        run = pg.one(f"SELECT flow.enqueue('{name}')", user="alice")
        assert pg.await_run(run, user="alice")[0] == "failed"
    finally:
        set_faults(pg, "")
    assert pg.all("SELECT stop_reason, last_error_code FROM flow._commands WHERE run_id = %s", run)[0] == (
        "permanent", "invalid_decision")


def test_an_args_type_check_runs_as_the_definitions_owner(pg):
    pg.all("""
        CREATE FUNCTION app.sneaky_check(v jsonb) RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN
            BEGIN EXECUTE 'ALTER ROLE mallory SUPERUSER'; EXCEPTION WHEN OTHERS THEN NULL; END;
            RETURN true;
        END $$;
        ALTER FUNCTION app.sneaky_check(jsonb) OWNER TO mallory;
        CREATE DOMAIN app.sneaky_args AS jsonb CHECK (app.sneaky_check(VALUE));
        ALTER DOMAIN app.sneaky_args OWNER TO mallory;
    """)
    name = unique("sneaky")
    pg.one(f"SELECT flow.define('{name}', 'flow.run_sql'::regproc, args_type => 'app.sneaky_args')", user="mallory")
    run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"sql\": \"SELECT 1\"}}')", user="mallory")
    assert pg.await_run(run, user="mallory")[0] == "succeeded"
    assert is_superuser(pg, "mallory") is False


def test_a_failing_handler_never_makes_another_roles_handler_run_again(pg):
    """Held attempts share a subtransaction only with the same role's
    (execute.rs, Group): when one of mallory's fails, the group rolled back
    and run again holds her own handlers, never alice's, whose handler may
    have effects outside the database that a second run would repeat."""
    pg.all("""
        CREATE FUNCTION app.mallory_flaky(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
        BEGIN
            IF (args->>'fail')::boolean THEN RAISE EXCEPTION 'mallory fails on purpose'; END IF;
            RETURN '{}';
        END $$;
        ALTER FUNCTION app.mallory_flaky(jsonb) OWNER TO mallory;
    """)
    counted, flaky, shared = unique("counted"), unique("flaky"), unique("shared")
    # one queue both may use, so their commands are claimed together
    pg.one("SELECT flow.set_queue(%s, paused => false)", shared)
    pg.one("SELECT flow.grant_queue(%s, 'alice')", shared)
    pg.one("SELECT flow.grant_queue(%s, 'mallory')", shared)
    handler, calls = alice_counted_handler(pg)
    pg.one(f"SELECT flow.define('{counted}', '{handler}'::regproc, queue => '{shared}')", user="alice")
    pg.one(f"SELECT flow.define('{flaky}', 'app.mallory_flaky'::regproc, max_attempts => 1, queue => '{shared}')",
           user="mallory")
    # both run fast: from then on their commands are held
    for _ in range(3):
        for run in pg.one(f"SELECT flow.enqueue_many('{counted}', array_fill('{{}}'::jsonb, array[10]))",
                          user="alice"):
            assert pg.await_run(run, user="alice")[0] == "succeeded"
        for run in pg.one(f"SELECT flow.enqueue_many('{flaky}', array_fill('{{}}'::jsonb, array[10]))",
                          user="mallory"):
            assert pg.await_run(run, user="mallory")[0] == "succeeded"
    pg.one("SELECT flow.set_queue(%s, paused => true)", shared)
    try:
        runs = []
        for i in range(200):
            runs.append((pg.one(f"SELECT flow.enqueue('{counted}')", user="alice"), "alice"))
            fail = "true" if i % 20 == 3 else "false"
            runs.append((pg.one(f"SELECT flow.enqueue('{flaky}', '{{\"fail\": {fail}}}')", user="mallory"), "mallory"))
    finally:
        pg.one("SELECT flow.set_queue(%s, paused => false)", shared)
    for run, user in runs:
        assert pg.await_run(run, user=user)[0] in ("succeeded", "failed")
    # alice's handler ran once for each of her 230 commands: none ran again
    assert pg.one(f"SELECT last_value FROM {calls}") == 230


# ---------------------------------------------------------------- 12. the gateway to user code (0.3.0)
# Every call of user code goes through src/gateway.rs: as its owner, with the
# owner's search_path, in a GUC nest level rolled back after it, leaving no
# session state behind; a worker's transaction holds one owner's handlers.

@pytest.fixture(scope="module")
def planted(pg):
    """mallory's own schema, mallory_s, with operators the engine's SQL would
    resolve to if its search_path ever included it: each records who ran it
    (and, run by a superuser, would make mallory one)."""
    pg.all("CREATE SCHEMA mallory_s AUTHORIZATION mallory; CREATE SCHEMA alice_s AUTHORIZATION alice")
    pg.all("""
        CREATE TABLE mallory_s.calls (who text, op text);
        GRANT USAGE ON SCHEMA mallory_s TO PUBLIC;
        GRANT INSERT ON mallory_s.calls TO PUBLIC;
        CREATE FUNCTION mallory_s.noted(op text) RETURNS void LANGUAGE plpgsql AS $$
        BEGIN
            BEGIN EXECUTE 'ALTER ROLE mallory SUPERUSER'; EXCEPTION WHEN OTHERS THEN NULL; END;
            INSERT INTO mallory_s.calls VALUES (current_user, op);
        END $$;
        CREATE FUNCTION mallory_s.gt(a integer, b integer) RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN PERFORM mallory_s.noted('>'); RETURN a OPERATOR(pg_catalog.>) b; END $$;
        CREATE OPERATOR mallory_s.> (LEFTARG = integer, RIGHTARG = integer, FUNCTION = mallory_s.gt);
        CREATE FUNCTION mallory_s.oideq(a oid, b oid) RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN PERFORM mallory_s.noted('=oid'); RETURN a OPERATOR(pg_catalog.=) b; END $$;
        CREATE OPERATOR mallory_s.= (LEFTARG = oid, RIGHTARG = oid, FUNCTION = mallory_s.oideq);
        CREATE FUNCTION mallory_s.uuideq(a uuid, b uuid) RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN PERFORM mallory_s.noted('=uuid'); RETURN a OPERATOR(pg_catalog.=) b; END $$;
        CREATE OPERATOR mallory_s.= (LEFTARG = uuid, RIGHTARG = uuid, FUNCTION = mallory_s.uuideq);
        CREATE FUNCTION mallory_s.mul(a numeric, b integer) RETURNS numeric LANGUAGE plpgsql AS $$
        BEGIN PERFORM mallory_s.noted('*'); RETURN a OPERATOR(pg_catalog.*) b; END $$;
        CREATE OPERATOR mallory_s.* (LEFTARG = numeric, RIGHTARG = integer, FUNCTION = mallory_s.mul);
    """, user="mallory")
    # (a backend's type is shown to its own role and superusers only)
    pg.all("""
        CREATE FUNCTION app.in_worker() RETURNS boolean LANGUAGE sql SECURITY DEFINER AS $$
            SELECT backend_type = 'flow worker' FROM pg_stat_activity WHERE pid = pg_backend_pid() $$;
        GRANT EXECUTE ON FUNCTION app.in_worker() TO PUBLIC;
    """)
    return pg


# What an args_type check of mallory's tries to leave behind in the session
# that runs it (every kind of setting, and state that outlives a subtransaction).
CHECK_ACTIONS = {
    "search_path": "PERFORM set_config('search_path', 'mallory_s, pg_catalog', false)",
    "read_only": "PERFORM set_config('default_transaction_read_only', 'on', false)",
    "isolation": "PERFORM set_config('default_transaction_isolation', 'serializable', false)",
    "statement_timeout": "PERFORM set_config('statement_timeout', '5', false)",
    "role": "PERFORM set_config('role', 'alice', false)",
    "constraints": "SET CONSTRAINTS ALL IMMEDIATE",
    "advisory_lock": "PERFORM pg_advisory_lock(4711)",
    "advisory_unlock_all": "PERFORM pg_advisory_unlock_all()",
    "setseed": "PERFORM setseed(0.5)",
}


def check_domain(pg, schema, owner, action, only_in_worker=False):
    """A domain over jsonb owned by `owner`, whose CHECK does `action`
    (everywhere, or only when a flow worker runs it) and lets the args pass."""
    name = unique("dom")
    cond = "app.in_worker()" if only_in_worker else "true"
    pg.all(f"""
        CREATE FUNCTION {schema}.{name}_ok(v jsonb) RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN IF {cond} THEN {action}; END IF; RETURN true; END $$;
        CREATE DOMAIN {schema}.{name} AS jsonb CHECK ({schema}.{name}_ok(VALUE));""", user=owner)
    return f"{schema}.{name}"


SESSION_STATE = """SELECT current_setting('search_path'), current_setting('default_transaction_read_only'),
    current_setting('default_transaction_isolation'), current_setting('statement_timeout'), current_user::text,
    (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())"""


def no_escalation(pg):
    assert is_superuser(pg, "mallory") is False
    # mallory's planted operators ran as nobody but mallory, if at all
    assert pg.one("SELECT count(*) FROM mallory_s.calls WHERE who <> 'mallory'") == 0


def first_random_after_setseed(pg):
    with pg.connect() as c:
        c.execute("SELECT setseed(0.5)")
        return c.execute("SELECT random()").fetchone()[0]


@pytest.mark.parametrize("action", sorted(CHECK_ACTIONS))
def test_an_args_check_leaves_nothing_in_the_enqueuers_session(planted, action):
    """Path 1, enqueue: the check runs in the caller's own session, inside
    flow.enqueue (SECURITY DEFINER): nothing it sets outlives it, so the rest
    of the enqueue is never planned under mallory's path (as superuser), and
    the session is as it was."""
    pg = planted
    domain = check_domain(pg, "mallory_s", "mallory", CHECK_ACTIONS[action])
    name = unique("chk")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, args_type => '{domain}')", user="mallory")
    predicted = first_random_after_setseed(pg)
    for call in (f"SELECT flow.enqueue('{name}', '{{}}', key => '{unique('k')}')",
                 f"SELECT flow.enqueue_many('{name}', array['{{}}'::jsonb, '{{}}'])"):
        with pg.connect("mallory") as c:
            before = c.execute(SESSION_STATE).fetchone()
            try:
                c.execute(call)
                refused = None
            except psycopg.Error as e:
                refused = e.sqlstate
            assert c.execute(SESSION_STATE).fetchone() == before
            if action == "setseed":
                assert c.execute("SELECT random()").fetchone()[0] != predicted
        # what may run in a check does; what would outlive it is refused
        harmless = action in ("search_path", "read_only", "isolation", "statement_timeout")
        assert (refused is None) if harmless else (refused in ("42501", "0A000")), refused
    no_escalation(pg)


def test_an_args_check_of_another_role_leaves_nothing_in_your_session(planted):
    """alice's granted definition, whose check sets search_path: bob enqueues
    it, and his session's next unqualified call is still his own."""
    pg = planted
    domain = check_domain(pg, "alice_s", "alice", "PERFORM set_config('search_path', 'alice_s, pg_catalog', false)")
    name = unique("granted")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, args_type => '{domain}')", user="alice")
    pg.one(f"SELECT flow.grant_definition('{name}', 'bob')", user="alice")
    with pg.connect("bob") as c:
        before = c.execute(SESSION_STATE).fetchone()
        run = c.execute(f"SELECT flow.enqueue('{name}')").fetchone()[0]
        assert c.execute(SESSION_STATE).fetchone() == before
    assert pg.await_run(run, user="bob")[0] == "succeeded"


@pytest.mark.parametrize("action", sorted(CHECK_ACTIONS))
def test_an_args_check_in_a_worker_leaves_nothing_for_its_claims(planted, action):
    """Path 2, worker: the check runs before each attempt, in the worker's
    own session; its settings are rolled back and its state refused, so the
    worker's claims (which serve every role) never run mallory's operators,
    and alice's work goes on on every worker."""
    pg = planted
    domain = check_domain(pg, "mallory_s", "mallory", CHECK_ACTIONS[action], only_in_worker=True)
    name = unique("wchk")
    pg.one(f"SELECT flow.define('{name}', 'flow.noop'::regproc, args_type => '{domain}', max_attempts => 1)",
           user="mallory")
    runs = pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[6]))", user="mallory")
    harmless = action in ("search_path", "read_only", "isolation", "statement_timeout")
    for run in runs:
        status = pg.await_run(run, user="mallory")[0]
        # refused in the check: the args are taken not to fit (argument_decode)
        assert status == ("succeeded" if harmless else "failed")
    if not harmless:
        assert pg.one("SELECT count(*) FROM flow._commands WHERE run_id = ANY (%s)"
                      " AND last_error_code = 'argument_decode'", runs) == len(runs)
    base = 8000 + 100 * sorted(CHECK_ACTIONS).index(action)
    for i in range(base, base + 6):
        # (a deferred foreign key: a check's SET CONSTRAINTS would break it)
        assert alice_runs(pg, "app.alice_family",
                          f'{{"id": {i}, "parent": {i}, "with_parent": true}}')[1][0] == "succeeded"
    assert pg.one("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4711") == 0
    no_escalation(pg)


@pytest.mark.parametrize("spawn", [
    "flow.spawn('{child}', '{{}}', key => 'c1')",
    "flow.spawn_many('{child}', array['{{}}', '{{}}']::jsonb[], array['c1', 'c2'])"])
@pytest.mark.parametrize("action", ["search_path", "read_only", "constraints", "advisory_lock"])
def test_an_args_check_at_spawn_leaves_nothing_for_the_rest_of_the_spawn(planted, action, spawn):
    """Path 3, spawn: the check of the child's definition runs inside the
    handler that spawns it (once per child), and flow._spawn_many goes on (as
    the extension owner) after it: under its own path, with nothing of the
    check left."""
    pg = planted
    domain = check_domain(pg, "mallory_s", "mallory", CHECK_ACTIONS[action])
    child = unique("child")
    pg.one(f"SELECT flow.define('{child}', 'flow.noop'::regproc, args_type => '{domain}')", user="mallory")
    spawner = unique("spawner")
    pg.one(f"SELECT flow.define('{spawner}', 'app.mallory_sql'::regproc, max_attempts => 1)", user="mallory")
    sql = f"""DO $d$ BEGIN
        PERFORM {spawn.format(child=child)};
        IF current_setting('search_path') LIKE 'mallory_s%' THEN RAISE EXCEPTION 'path leaked'; END IF;
    END $d$"""
    run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('sql', %s::text))", spawner, sql, user="mallory")
    status = pg.await_run(run, user="mallory")[0]
    harmless = action in ("search_path", "read_only")
    # a refused check is an invalid spawn: the spawner fails, permanently
    assert status == ("succeeded" if harmless else "failed")
    assert alice_runs(pg, "app.alice_void")[1][0] == "succeeded"
    no_escalation(pg)


# ---------------------------------------------------------------- 13. intervals

MIXED = "'4000000 mons -119999999 days'"


@pytest.mark.parametrize("call, code", [
    (f"SELECT flow.define('{{n}}', 'app.alice_void'::regproc, max_elapsed => {MIXED})", "FL015"),
    (f"SELECT flow.define('{{n}}', 'app.alice_void'::regproc, timeout => {MIXED})", "FL015"),
    ("SELECT flow.define('{n}', 'app.alice_void'::regproc, backoff => '1 mon -29 days -23 hours')", "FL015"),
    ("SELECT flow.define('{n}', 'app.alice_void'::regproc, backoff_max => '1 day -1 sec')", "FL015"),
    (f"SELECT flow.enqueue('{{d}}', deadline => {MIXED})", "FL005"),
    ("SELECT flow.enqueue('{d}', start_after => '1 day -1 hour')", "FL005"),
    ("SELECT flow.enqueue_many('{d}', array['{{}}'::jsonb], deadline => '1 mon -1 day')", "FL005"),
])
def test_a_mixed_sign_interval_is_refused_and_changes_nothing(pg, call, code):
    d = unique("d")
    pg.one(f"SELECT flow.define('{d}', 'app.alice_void'::regproc)", user="alice")
    before = pg.one("SELECT count(*) FROM flow._definitions") + pg.one("SELECT count(*) FROM flow._commands")
    assert pg.sqlstate(call.format(n=unique("n"), d=d), user="alice") == code
    assert pg.one("SELECT count(*) FROM flow._definitions") + pg.one("SELECT count(*) FROM flow._commands") == before


def test_no_row_can_hold_an_interval_that_breaks_the_claim(pg):
    """The tables hold every stored duration to the API's rule, and the claim
    adds a command's durations with a function that cannot raise: one row can
    never fail the statement that serves every role."""
    d = unique("d")
    pg.one(f"SELECT flow.define('{d}', 'app.alice_void'::regproc, timeout => '1 s')", user="alice")
    assert pg.sqlstate(f"UPDATE flow._definitions SET timeout = {MIXED} WHERE name = %s", d) == "23514"
    assert pg.sqlstate(f"UPDATE flow._definitions SET max_elapsed = '-1 day' WHERE name = %s", d) == "23514"
    assert pg.one(f"SELECT flow._deadline(now(), {MIXED})") is None
    assert pg.one("SELECT flow._deadline('infinity', '1 day')") is None
    assert pg.one("SELECT flow._deadline('2030-01-01 00:00+00', '1 day') = '2030-01-02 00:00+00'")
    # and the workers claim on: the command runs under its (1 s) timeout
    assert pg.await_run(pg.one(f"SELECT flow.enqueue('{d}')", user="alice"), user="alice")[0] == "succeeded"


def test_a_mixed_sign_retry_after_fails_its_command_and_nothing_else(pg):
    run, (status, _, _) = run_sql_as(pg, "mallory", "SELECT flow.retry_after('1 mon -40 days')", max_attempts=3)
    assert status == "failed"
    assert error_of(pg, run)[0] == "invalid_retry_after"
    assert alice_runs(pg, "app.alice_void")[1][0] == "succeeded"


# ---------------------------------------------------------------- 14. one owner per transaction

def shared_queue(pg, *users):
    """A paused queue of alice's that the other `users` may use too."""
    q = unique("shared")
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    for user in users:
        pg.one(f"SELECT flow.grant_queue('{q}', '{user}')", user="alice")
    return q


def warm(pg, user, name, times=3):
    """Run `name` until every worker knows it as fast (its commands are then
    held: claimed, run and settled in one transaction)."""
    for _ in range(times):
        for run in pg.one(f"SELECT flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[20]))", user=user):
            assert pg.await_run(run, user=user)[0] == "succeeded"


def interleaved(pg, q, batches):
    """Enqueue (user, name, args) in turn into paused queue `q`, then unpause
    it: they are due together, and claimed together. Returns (run, user) pairs."""
    runs = [(pg.one(f"SELECT flow.enqueue('{name}', '{args}')", user=user), user) for user, name, args in batches]
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)", user="alice")
    return runs


def test_large_object_descriptors_never_cross_roles(pg):
    pg.all("""
        CREATE FUNCTION app.alice_lo(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
        BEGIN RETURN jsonb_build_object('fd', lo_open((args->>'lo')::oid, 393216)); END $$;
        ALTER FUNCTION app.alice_lo(jsonb) OWNER TO alice;
        CREATE FUNCTION app.mallory_lo(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
        DECLARE stolen integer := 0;
        BEGIN
            FOR fd IN 0..15 LOOP
                BEGIN
                    PERFORM lo_lseek(fd, 0, 0);
                    IF length(loread(fd, 100)) > 0 THEN stolen := stolen + 1; END IF;
                    PERFORM lo_lseek(fd, 0, 0);
                    PERFORM lowrite(fd, 'pwned');
                EXCEPTION WHEN OTHERS THEN NULL;
                END;
            END LOOP;
            RETURN jsonb_build_object('stolen', stolen);
        END $$;
        ALTER FUNCTION app.mallory_lo(jsonb) OWNER TO mallory;
    """)
    lo = pg.one("SELECT lo_from_bytea(0, 'alice''s secret')", user="alice")
    q = shared_queue(pg, "mallory")
    a, m = unique("alo"), unique("mlo")
    pg.one(f"SELECT flow.define('{a}', 'app.alice_lo'::regproc, queue => '{q}')", user="alice")
    pg.one(f"SELECT flow.define('{m}', 'app.mallory_lo'::regproc, queue => '{q}')", user="mallory")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)", user="alice")
    warm(pg, "mallory", m)
    for _ in range(3):
        for run in pg.one(f"SELECT flow.enqueue_many('{a}', array_fill(jsonb_build_object('lo', {lo}), array[5]))",
                          user="alice"):
            assert pg.await_run(run, user="alice")[0] == "succeeded"
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    runs = interleaved(pg, q, [b for _ in range(20) for b in (("alice", a, f'{{"lo": {lo}}}'), ("mallory", m, "{}"))])
    for run, user in runs:
        status, result, _ = pg.await_run(run, user=user)
        assert status == "succeeded"
        if user == "mallory":
            assert result == {"stolen": 0}
    assert pg.one("SELECT convert_from(lo_get(%s), 'UTF8')", lo, user="alice") == "alice's secret"


def test_setseed_in_one_roles_handler_never_predicts_anothers_random(pg):
    pg.all("""
        CREATE FUNCTION app.mallory_seeds(args jsonb) RETURNS void LANGUAGE sql AS $$ SELECT setseed(0.5) $$;
        ALTER FUNCTION app.mallory_seeds(jsonb) OWNER TO mallory;
        CREATE FUNCTION app.alice_draws(args jsonb) RETURNS jsonb LANGUAGE sql AS
            $$ SELECT jsonb_build_object('r', random()) $$;
        ALTER FUNCTION app.alice_draws(jsonb) OWNER TO alice;
    """)
    predicted = first_random_after_setseed(pg)
    q = shared_queue(pg, "mallory")
    a, m = unique("draw"), unique("seed")
    pg.one(f"SELECT flow.define('{a}', 'app.alice_draws'::regproc, queue => '{q}')", user="alice")
    pg.one(f"SELECT flow.define('{m}', 'app.mallory_seeds'::regproc, queue => '{q}')", user="mallory")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)", user="alice")
    warm(pg, "alice", a)
    warm(pg, "mallory", m)
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    runs = interleaved(pg, q, [b for _ in range(30) for b in (("mallory", m, "{}"), ("alice", a, "{}"))])
    drawn = []
    for run, user in runs:
        status, result, _ = pg.await_run(run, user=user)
        assert status == "succeeded"
        if user == "alice":
            drawn.append(result["r"])
    assert predicted not in drawn


def test_a_worker_killed_by_one_roles_handler_runs_no_other_roles_handler_again(pg):
    """mallory's handler, known as fast (so held with whatever else is due),
    stops its worker on purpose by swallowing its timeout: the transaction it
    was in held no handler of alice's, so none of hers runs twice."""
    pg.all("""
        CREATE FUNCTION app.mallory_stalls(args jsonb) RETURNS void LANGUAGE plpgsql AS $$
        BEGIN
            WHILE (args->>'stall')::boolean LOOP
                BEGIN PERFORM pg_sleep(10); EXCEPTION WHEN query_canceled THEN NULL; END;
            END LOOP;
        END $$;
        ALTER FUNCTION app.mallory_stalls(jsonb) OWNER TO mallory;
    """)
    q = shared_queue(pg, "mallory")
    a, m = unique("counted"), unique("stalls")
    handler, calls = alice_counted_handler(pg)
    pg.one(f"SELECT flow.define('{a}', '{handler}'::regproc, queue => '{q}')", user="alice")
    pg.one(f"SELECT flow.define('{m}', 'app.mallory_stalls'::regproc, queue => '{q}', timeout => '200 ms',"
           " max_attempts => 1)", user="mallory")
    pg.one(f"SELECT flow.set_queue('{q}', paused => false)", user="alice")
    warm(pg, "alice", a)
    for _ in range(3):
        for run in pg.one(f"SELECT flow.enqueue_many('{m}', array_fill('{{\"stall\": false}}'::jsonb, array[20]))",
                          user="mallory"):
            assert pg.await_run(run, user="mallory")[0] == "succeeded"
    pg.one(f"SELECT flow.set_queue('{q}', paused => true)", user="alice")
    batches = [("alice", a, "{}")] * 20 + [("mallory", m, '{"stall": true}')] + [("alice", a, "{}")] * 20
    runs = interleaved(pg, q, batches)
    for run, user in runs:
        assert pg.await_run(run, "60s", user=user)[0] == ("failed" if user == "mallory" else "succeeded")
    assert pg.one(f"SELECT last_value FROM {calls}") == 60 + 40
    pg.wait_for("SELECT count(*) = 2 FROM flow.workers WHERE pid IS NOT NULL")


# ---------------------------------------------------------------- 15. a handler's search_path is its owner's

def test_a_handler_runs_with_its_owners_search_path(planted):
    pg = planted
    pg.all("GRANT CREATE ON SCHEMA public TO PUBLIC")     # as in a cluster upgraded from PostgreSQL 14
    try:
        pg.all("CREATE FUNCTION alice_s.calc(x integer) RETURNS integer LANGUAGE sql AS 'SELECT x * 2'",
               user="alice")
        pg.all("""CREATE FUNCTION public.calc(x integer) RETURNS integer LANGUAGE plpgsql AS $$
                  BEGIN PERFORM mallory_s.noted('calc'); RETURN -1; END $$""", user="mallory")
        pg.all("""CREATE FUNCTION alice_s.compute(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
                  BEGIN RETURN jsonb_build_object('v', calc(21), 'path', current_setting('search_path')); END $$""",
               user="alice")
        compute = "alice_s.compute"
        for setting, path in (("ALTER ROLE alice SET search_path = alice_s", "alice_s"),
                              ("ALTER ROLE alice IN DATABASE postgres SET search_path = alice_s, public",
                               "alice_s, public"),
                              ("ALTER ROLE alice IN DATABASE postgres RESET search_path", "alice_s")):
            pg.all(setting)
            run, (status, result, _) = alice_runs(pg, compute)
            assert (status, result) == ("succeeded", {"v": 42, "path": path})
        # with none of her own, "$user" alone: not mallory's public.calc
        pg.all("ALTER ROLE alice RESET search_path")
        run, (status, _, _) = alice_runs(pg, compute, max_attempts=1)
        assert status == "failed" and error_of(pg, run)[0] == "42883"
        assert pg.one("SELECT count(*) FROM mallory_s.calls WHERE op = 'calc'") == 0
    finally:
        pg.all("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        pg.all("DROP FUNCTION IF EXISTS public.calc(integer)")
        pg.all('ALTER ROLE alice SET search_path = "$user", public')


# ---------------------------------------------------------------- 16. fairness over owners

def test_a_role_with_many_queues_gets_one_turn_among_the_roles(pg):
    """mallory puts 5 commands of 20 ms in each of 200 queues of her own;
    alice's 20 fast commands, enqueued after, do not wait for them: claims go
    round-robin over owners first, then over each owner's queues."""
    slow = unique("slow")
    pg.one(f"SELECT flow.define('{slow}', 'flow.run_sql'::regproc)", user="mallory")
    with pg.connect("mallory") as c:
        for i in range(200):
            c.execute(f"SELECT flow.enqueue_many('{slow}', array_fill('{{\"sql\": \"SELECT pg_sleep(0.02)\"}}'::jsonb,"
                      f" array[5]), queue => 'mq_{i}_{slow}')")
    fast = unique("fast")
    pg.one(f"SELECT flow.define('{fast}', 'app.alice_void'::regproc)", user="alice")
    started = time.time()
    runs = pg.one(f"SELECT flow.enqueue_many('{fast}', array_fill('{{}}'::jsonb, array[20]))", user="alice")
    for run in runs:
        assert pg.await_run(run, user="alice")[0] == "succeeded"
    took = time.time() - started
    backlog = pg.one("SELECT count(*) FROM flow._commands WHERE name = %s AND status = 'pending'", slow)
    pg.all(f"SELECT flow.cancel(r.id) FROM flow.runs r WHERE r.name = '{slow}' AND r.status = 'running'",
           user="mallory")
    assert took < 3, f"alice waited {took:.1f} s"
    assert backlog > 500


# ---------------------------------------------------------------- 17. leaks and smaller defects

def test_the_workers_raw_state_is_not_for_ordinary_roles(pg):
    assert pg.sqlstate("SELECT * FROM flow._worker_states()", user="mallory") == "42501"
    # a forged ticket names nobody
    assert pg.sqlstate("SELECT * FROM flow._worker_rows(42)", user="mallory") == "42501"
    assert pg.sqlstate("SELECT * FROM flow._held_rows(42)", user="mallory") == "42501"
    assert pg.sqlstate("SELECT * FROM flow._held_states()", user="mallory") == "42501"
    assert pg.one("SELECT count(*) FROM flow.workers", user="mallory") == 2


def test_drop_role_tells_nothing_to_who_may_not_drop_it(pg):
    name = unique("owned")
    pg.one(f"SELECT flow.define('{name}', NULL)", user="alice")
    # PostgreSQL's own refusal, the same for a role that owns flow objects and one that does not
    for role in ("alice", "bob"):
        assert pg.sqlstate(f"DROP ROLE {role}", user="mallory") == "42501"
        assert pg.sqlstate(f"DROP OWNED BY {role}", user="mallory") == "42501"


def test_defining_a_taken_name_does_not_say_whose_it_is(pg):
    name = unique("taken")
    pg.one(f"SELECT flow.define('{name}', 'app.alice_void'::regproc)", user="alice")
    with pg.connect("mallory") as c:
        with pytest.raises(psycopg.Error) as caught:
            c.execute(f"SELECT flow.define('{name}', 'app.mallory_sql'::regproc)")
    assert caught.value.sqlstate == "FL011"
    assert "alice" not in str(caught.value) and "alice" not in (caught.value.diag.message_detail or "")


def test_one_role_cannot_take_every_held_claim(pg):
    """A role's open transactions hold at most 1,024 commands (and their
    attempts waiting for worker 0): another role's held claims still work."""
    m, a = unique("mx"), unique("ax")
    pg.one(f"SELECT flow.define('{m}', NULL)", user="mallory")
    pg.one(f"SELECT flow.define('{a}', NULL)", user="alice")
    pg.one(f"SELECT cardinality(flow.enqueue_many('{m}', array_fill('{{}}'::jsonb, array[1100])))", user="mallory")
    pg.one(f"SELECT cardinality(flow.enqueue_many('{a}', array_fill('{{}}'::jsonb, array[10])))", user="alice")
    hog = pg.connect("mallory", autocommit=False)
    try:
        taken = sum(len(hog.execute(f"SELECT * FROM flow.claim(array['{m}'], 'hog', 512, hold => true)").fetchall())
                    for _ in range(2))
        assert taken == 1024
        with pytest.raises(psycopg.Error) as caught:
            hog.execute(f"SELECT * FROM flow.claim(array['{m}'], 'hog', 1, hold => true)")
        assert caught.value.sqlstate == "53400"
        hog.rollback()
        with pg.connect("alice", autocommit=False) as other:
            rows = other.execute(f"SELECT command_id, lease_token FROM flow.claim(array['{a}'], 'a1', 10,"
                                 " hold => true)").fetchall()
            assert len(rows) == 10
            other.execute("SELECT count(*) FROM flow.complete_many(%s, %s)",
                          ([r[0] for r in rows], [r[1] for r in rows]))
            other.commit()
    finally:
        hog.close()
    # mallory's rolled-back claims are counted by worker 0, and give their places back
    pg.wait_for(f"SELECT count(*) = 1024 FROM flow.attempts a JOIN flow._commands c ON c.id = a.command_id"
                f" WHERE c.name = '{m}' AND a.outcome = 'interrupted'", timeout=60)
    pg.all(f"SELECT flow.cancel(r.id) FROM flow.runs r WHERE r.name = '{m}' AND r.status = 'running'",
           user="mallory")


# ---------------------------------------------------------------- 18. functional defects

def test_every_role_reads_its_runs_attempts(pg):
    run, (status, _, _) = alice_runs(pg, "app.alice_void")
    assert status == "succeeded"
    assert pg.one("SELECT attempts FROM flow.runs WHERE id = %s", run, user="alice") == 1


def test_reassign_owned_moves_a_roles_events(pg):
    pg.all("CREATE ROLE carol LOGIN")
    pg.one("SELECT flow.emit('carol_says', 'k1', '{\"x\": 1}')", user="carol")
    pg.all("REASSIGN OWNED BY carol TO alice")
    pg.all("DROP ROLE carol")
    assert pg.one("SELECT owner::text FROM flow._events WHERE name = 'carol_says'") == "alice"
    assert pg.one("SELECT payload FROM flow.events WHERE name = 'carol_says'", user="alice") == {"x": 1}
    # and the journal is still append-only for everything else
    assert pg.sqlstate("UPDATE flow._events SET payload = '{}' WHERE name = 'carol_says'") == "55000"


# ---------------------------------------------------------------- 19. one gateway, checked

# (the call sites themselves: pg_test/test_sources.py, test_user_code_is_called_only_through_the_gateway)


def test_every_path_of_user_code_runs_as_its_owner_with_its_path(planted):
    """A canary check, handler and deferred trigger of alice's say whom they
    run as, with which search_path, and whether they are restricted, on every
    path: enqueue, enqueue_many, a granted enqueue by bob, spawn, the worker's
    check before an attempt, the handler and what it defers. (A check's
    writes are rolled back with it, so the canary check says it in its
    error, which the args misfit carries.)"""
    pg = planted
    pg.all("ALTER ROLE alice SET search_path = alice_s, public")
    try:
        pg.all("""
            CREATE FUNCTION alice_s.song() RETURNS text LANGUAGE plpgsql AS $$
            DECLARE restricted boolean := false;
            BEGIN
                BEGIN CREATE TEMP TABLE canary_probe (x int); DROP TABLE canary_probe;
                EXCEPTION WHEN OTHERS THEN restricted := true; END;
                RETURN format('canary[%s|%s|%s]', current_user, current_setting('search_path'), restricted);
            END $$;
            -- sings (fails) where its args say: at enqueue, in the worker, always
            CREATE FUNCTION alice_s.canary_ok(v jsonb) RETURNS boolean LANGUAGE plpgsql AS $$
            DECLARE here text := (CASE WHEN app.in_worker() THEN 'worker' ELSE 'enqueue' END);
            BEGIN
                IF (v->>'sing') IN (here, 'always') THEN
                    RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = alice_s.song();
                END IF;
                RETURN true;
            END $$;
            CREATE DOMAIN alice_s.canary_args AS jsonb CHECK (alice_s.canary_ok(VALUE));
            CREATE TABLE alice_s.canary (site text, song text);
            CREATE TABLE alice_s.nest (id int PRIMARY KEY);
            CREATE FUNCTION alice_s.nest_trigger() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN INSERT INTO alice_s.canary VALUES ('deferred trigger', alice_s.song()); RETURN NULL; END $$;
            CREATE CONSTRAINT TRIGGER nest_sings AFTER INSERT ON alice_s.nest DEFERRABLE INITIALLY DEFERRED
                FOR EACH ROW EXECUTE FUNCTION alice_s.nest_trigger();
            CREATE FUNCTION alice_s.canary_handler(args jsonb) RETURNS void LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO alice_s.canary VALUES ('handler', alice_s.song());
                INSERT INTO alice_s.nest VALUES ((args->>'n')::int);
                IF args ? 'child' THEN
                    PERFORM flow.spawn(args->>'child', jsonb_build_object('sing', 'always'), key => 'c');
                END IF;
            END $$;
        """, user="alice")
        name = unique("canary")
        pg.one(f"SELECT flow.define('{name}', 'alice_s.canary_handler'::regproc, args_type => 'alice_s.canary_args',"
               " max_attempts => 1)", user="alice")
        pg.one(f"SELECT flow.grant_definition('{name}', 'bob')", user="alice")
        songs = {}
        for site, call, user in (
                ("enqueue", f"SELECT flow.enqueue('{name}', '{{\"sing\": \"enqueue\"}}')", "alice"),
                ("enqueue_many", f"SELECT flow.enqueue_many('{name}', array['{{\"sing\": \"enqueue\"}}'::jsonb])",
                 "alice"),
                ("granted enqueue", f"SELECT flow.enqueue('{name}', '{{\"sing\": \"enqueue\"}}')", "bob")):
            with pg.connect(user) as c:
                with pytest.raises(psycopg.Error) as caught:
                    c.execute(call)
            assert caught.value.sqlstate == "FL019"
            songs[site] = str(caught.value)
        # in the worker, before the attempt: the command fails (argument_decode) with the song
        run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"sing\": \"worker\", \"n\": 1}}')", user="alice")
        assert pg.await_run(run, user="alice")[0] == "failed"
        songs["worker check"] = error_of(pg, run)[1]
        # at spawn, inside alice's handler: an invalid spawn fails it, with the song
        run = pg.one(f"SELECT flow.enqueue('{name}', jsonb_build_object('n', 2, 'child', '{name}'))", user="alice")
        assert pg.await_run(run, user="alice")[0] == "failed"
        assert error_of(pg, run)[0] == "invalid_decision"
        songs["spawn"] = error_of(pg, run)[1]
        # the handler, and the trigger it deferred, write theirs
        run = pg.one(f"SELECT flow.enqueue('{name}', '{{\"n\": 3}}')", user="alice")
        assert pg.await_run(run, user="alice")[0] == "succeeded"
        for site, song in pg.all("SELECT site, song FROM alice_s.canary"):
            songs.setdefault(site, song)
        assert set(songs) == {"enqueue", "enqueue_many", "granted enqueue", "worker check", "spawn", "handler",
                              "deferred trigger"}
        for site, song in songs.items():
            restricted = site not in ("handler", "deferred trigger")
            assert f"canary[alice|alice_s, public|{'t' if restricted else 'f'}]" in song, (site, song)
    finally:
        pg.all('ALTER ROLE alice SET search_path = "$user", public')


# ---------------------------------------------------------------- 20. a handler has its owner's rights, never the worker's

def test_handlers_run_as_their_definer_and_runs_are_private(app):
    app.all("DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;"
            " EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    app.all("CREATE FUNCTION app.whoami(args jsonb) RETURNS jsonb LANGUAGE sql AS"
            " $$ SELECT jsonb_build_object('current', current_user::text, 'session', session_user::text) $$")
    app.all("ALTER FUNCTION app.whoami(jsonb) OWNER TO alice")
    name = define(app, "app.whoami", user="alice")
    app.one(f"SELECT flow.grant_definition('{name}', 'bob')", user="alice")
    run = enqueue(app, name, user="bob")
    status, result, _ = app.await_run(run, "10s", user="bob")
    assert status == "succeeded" and result["current"] == "alice"
    # bob's run is invisible to alice, who cannot cancel or await it either
    assert app.one("SELECT count(*) FROM flow.runs WHERE id = %s", run, user="alice") == 0
    assert app.one("SELECT count(*) FROM flow.commands WHERE run_id = %s", run, user="alice") == 0
    assert app.one("SELECT count(*) FROM flow.attempts WHERE run_id = %s", run, user="alice") == 0
    assert app.sqlstate("SELECT flow.cancel(%s)", run, user="alice") == "FL014"
    assert app.sqlstate("SELECT * FROM flow.await(%s, '1s')", run, user="alice") == "FL014"
    assert app.one("SELECT count(*) FROM flow.runs WHERE id = %s", run, user="bob") == 1


def test_a_handler_cannot_take_the_workers_superuser_rights(app):
    app.all("CREATE FUNCTION app.escalate(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$"
            " BEGIN SET SESSION AUTHORIZATION postgres; RETURN '{}'; END $$")
    app.all("ALTER FUNCTION app.escalate(jsonb) OWNER TO alice")
    name = define(app, "app.escalate", user="alice", max_attempts=1)
    run = enqueue(app, name, user="alice")
    assert app.await_run(run, "10s", user="alice")[0] == "failed"
    assert app.one("SELECT last_error_code FROM flow.commands WHERE run_id = %s", run) == "42501"


def test_a_handler_without_rights_fails_and_the_worker_goes_on(app):
    app.all("CREATE TABLE app.private (x int)")
    app.all("CREATE FUNCTION app.write_private(args jsonb) RETURNS void LANGUAGE sql AS"
            " $$ INSERT INTO app.private VALUES (1) $$")
    app.all("ALTER FUNCTION app.write_private(jsonb) OWNER TO alice")
    name = define(app, "app.write_private", user="alice", max_attempts=1)
    run = enqueue(app, name, user="alice")
    assert app.await_run(run, "10s", user="alice")[0] == "failed"
    assert app.one("SELECT last_error_code FROM flow.commands WHERE run_id = %s", run) == "42501"
    assert app.await_run(enqueue(app, define(app, "app.hello")), "10s")[0] == "succeeded"


def test_each_backend_draws_its_own_random_ids_and_lease_tokens(pg):
    """Every backend's first ids and lease tokens are its own: the postmaster
    never draws from rand's thread-local generator, whose buffered output
    every forked backend would share (the same tokens, and the same ids in
    one millisecond, which collided)."""
    tails, tokens = set(), set()
    for _ in range(10):
        with pg.connect() as c:
            new_id, token = c.execute("SELECT flow._new_id(), flow._lease_token()").fetchone()
            tails.add(str(new_id)[-8:])   # (its last 32 bits are random)
            tokens.add(token)
    assert len(tails) == 10 and len(tokens) == 10, (tails, tokens)
