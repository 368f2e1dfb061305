"""Groups: commands of one queue with a group_key are claimed round-robin
across the groups that have due work, and flow.set_queue(group_concurrency
=> n) lets at most n of one group run at once, across every claimant
(sql/claim.sql, flow._claim and flow._groups_of)."""
import statistics
import threading
import time

import psycopg
import pytest

from conftest import app_cluster, claim, external, priorities_noted, unique

GROUP_APP = """
    CREATE TABLE app.ran (n serial PRIMARY KEY, queue text, grp text, began timestamptz DEFAULT clock_timestamp(),
                          ended timestamptz);
    GRANT ALL ON app.ran, app.ran_n_seq TO PUBLIC;
    -- records its start; sleeps args.sleep seconds; records its end
    CREATE FUNCTION app.work(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE id integer;
    BEGIN
        INSERT INTO app.ran (queue, grp) VALUES (ctx.queue, args->>'g') RETURNING n INTO id;
        PERFORM pg_sleep(coalesce((args->>'sleep')::float, 0));
        UPDATE app.ran SET ended = clock_timestamp() WHERE n = id;
        RETURN '{}';
    END $$;
    -- a root that spawns one child per element of args.groups, in that group
    CREATE FUNCTION app.fan(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE g text;
    BEGIN
        FOR g IN SELECT jsonb_array_elements_text(args->'groups') LOOP
            PERFORM flow.spawn(args->>'child', jsonb_build_object('g', g), key => g, group_key => g);
        END LOOP;
        RETURN '{}';
    END $$;
    DO $$ BEGIN CREATE ROLE mallory LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
"""


@pytest.fixture(scope="module")
def pg():
    cluster = app_cluster(GROUP_APP, conf=("flow.workers = 2",))
    yield cluster
    cluster.stop()


def grouped_queue(pg, **settings):
    queue, name = unique("gq"), unique("work")
    pg.one(f"SELECT flow.define('{name}', 'app.work(jsonb, flow.context)'::regprocedure, queue => '{queue}')")
    params = "".join(f", {k} => {v}" for k, v in settings.items())
    pg.one(f"SELECT flow.set_queue('{queue}', paused => true{params})")
    return queue, name


def enqueue_group(pg, name, group, n, sleep=0):
    return pg.one("SELECT flow.enqueue_many(%s, array_fill(jsonb_build_object('g', %s::text, 'sleep', %s::float),"
                  " ARRAY[%s]), group_key => %s)", name, group, sleep, n, group)


def test_the_views_show_a_leased_command_as_of_the_readers_snapshot(pg):
    """flow.commands takes a held attempt from the workers' shared memory
    (nothing in the table says it runs), a leased one from its row. A
    worker's word on a leased command, read after the reader's snapshot,
    showed it running beside the group's command before it (which the
    snapshot still saw running): group_concurrency 1 seemed broken."""
    queue, name = grouped_queue(pg)
    run = pg.one("SELECT flow.enqueue(%s, '{\"g\": \"view\", \"sleep\": 3}', start_after => '1 s')", name)
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    with pg.connect() as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert reader.execute("SELECT status FROM flow.commands WHERE run_id = %s", (run,)).fetchone()[0] == "pending"
        # (its first run in each worker: leased, its row says running once its claim commits)
        pg.wait_for("SELECT count(*) = 1 FROM flow.workers w JOIN flow._commands c ON c.id = w.command_id"
                    " WHERE c.run_id = %s AND c.status = 'running'", run)
        assert reader.execute("SELECT status, attempts FROM flow.commands WHERE run_id = %s",
                              (run,)).fetchone() == ("pending", 0)
        assert reader.execute("SELECT count(*) FROM flow.attempts WHERE run_id = %s", (run,)).fetchone()[0] == 0
        reader.execute("COMMIT")
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s", run) == "running"
    assert pg.await_run(run)[0] == "succeeded"


def test_a_groups_backlog_delays_another_group_by_one_turn_at_most(pg):
    queue, name = grouped_queue(pg)
    enqueue_group(pg, name, "big", 3000)
    small = [f"small{i}" for i in range(30)]
    pg.one("SELECT flow.enqueue_many(%s, ARRAY(SELECT jsonb_build_object('g', g) FROM unnest(%s::text[]) g),"
           " group_keys => %s)", name, small, small)
    pg.one("SELECT flow.enqueue(%s, '{\"g\": \"none\"}')", name)   # (no group: a turn of its own)
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    pg.wait_for("SELECT count(*) = 3031 FROM app.ran WHERE queue = %s", queue, timeout=60)
    order = {g: n for g, n in pg.all("SELECT grp, min(n) FROM app.ran WHERE queue = %s GROUP BY grp", queue)}
    first = min(order.values())
    big_before = pg.one("SELECT count(*) FROM app.ran WHERE queue = %s AND grp = 'big' AND n < %s", queue,
                        max(order[g] for g in small + ["none"]))
    # every small group and the ungrouped command started before the big group's backlog ran:
    # at most its share of the claims that served the others went to it
    assert big_before <= 1000, big_before
    assert all(order[g] - first < 1100 for g in small + ["none"]), order


def test_a_new_groups_command_waits_for_part_of_a_backlogs_chunk_not_all_of_it(pg):
    """A chunk that runs a group's backlog ends once it has run GROUP_TURN
    (10 ms) when commands became due since its claim (src/worker.rs): a new
    group's command starts within about that and a claim, not after the
    backlog's whole 50 ms chunk (13 commands of 4 ms here)."""
    queue, name = grouped_queue(pg)
    enqueue_group(pg, name, "big", 1500, sleep=0.004)
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    pg.wait_for("SELECT count(*) >= 30 FROM app.ran WHERE queue = %s", queue)
    waits = []
    for i in range(12):
        group = f"new{i}"
        pg.one("SELECT flow.enqueue(%s, jsonb_build_object('g', %s::text), group_key => %s)", name, group, group)
        committed = time.time()
        pg.wait_for("SELECT count(*) = 1 FROM app.ran WHERE queue = %s AND grp = %s", queue, group)
        began = pg.one("SELECT extract(epoch FROM began) FROM app.ran WHERE queue = %s AND grp = %s", queue, group)
        waits.append(round((float(began) - committed) * 1000, 1))
        time.sleep(0.002 * i)   # (at different points of the backlog's chunks)
    still_big = pg.one("SELECT count(*) < 1500 FROM app.ran WHERE queue = %s AND grp = 'big'", queue)
    pg.one("SELECT flow.set_queue(%s, paused => true)", queue)
    assert still_big   # (the backlog ran throughout)
    # (the median: 3.6-6.1 ms in 5 runs here, 15-39 ms before; a chunk of 50 ms waited half of it on average)
    assert statistics.median(waits) < 12, sorted(waits)


def test_finding_a_lanes_groups_reads_no_groups_backlog(pg):
    """The loose scan that finds a lane's groups (flow._groups_of) probes the
    due index once per group: with 20,000 commands of one group waiting it
    reads a few pages, not the group's backlog, even before the table's
    statistics know of the burst (the planner then read and sorted all of
    it through _commands_due_grouped: 20 ms of every claim while 90,000
    waited)."""
    queue, name = grouped_queue(pg)
    enqueue_group(pg, name, "big", 20000)
    groups_of = "SELECT * FROM flow._groups_of(%s, flow._lane(%s, ''), 0::smallint, %s, 1000)"
    with pg.connect() as c:
        for from_hash in (1, 2**62):   # (before and after the group's hash: either lap)
            c.execute(groups_of, (queue, queue, from_hash))   # (planned: the catalog's pages are not counted)
            plan = c.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + groups_of,
                             (queue, queue, from_hash)).fetchone()[0][0]["Plan"]
            read = plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
            assert plan["Actual Rows"] == 1 and read < 100, (from_hash, read)


def test_group_concurrency_holds_across_two_workers_and_an_external_claimer(pg):
    queue, name = grouped_queue(pg, group_concurrency=1)
    ext = external(pg, queue=f"'{queue}'")
    for group in ("a", "b", "c"):
        enqueue_group(pg, name, group, 4, sleep=0.15)
    pg.one("SELECT flow.enqueue_many(%s, array_fill('{}'::jsonb, ARRAY[4]), group_key => 'a')", ext)
    held_external = []
    stop = threading.Event()

    def external_worker():
        with pg.connect() as conn:
            while not stop.is_set():
                for command_id, token, *_ in claim(conn, ext, max_=2):
                    running = conn.execute("SELECT count(*) FROM flow.commands WHERE queue = %s AND status = 'running'"
                                           " AND group_key = 'a'", (queue,)).fetchone()[0]
                    held_external.append(running)
                    time.sleep(0.1)   # (the external handler's work)
                    conn.execute("SELECT flow.complete(%s, %s, '{}')", (command_id, token))
                time.sleep(0.02)   # (its polling interval)

    thread = threading.Thread(target=external_worker)
    thread.start()
    peak = {}
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    deadline = time.time() + 30
    while time.time() < deadline:
        rows = pg.all("SELECT group_key, count(*) FROM flow.commands WHERE queue = %s AND status = 'running'"
                      " GROUP BY group_key", queue)
        for group, n in rows:
            peak[group] = max(peak.get(group, 0), n)
        if pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s AND finished_at IS NULL", queue) == 0:
            break
        time.sleep(0.01)   # (sampling interval)
    stop.set()
    thread.join()
    assert pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s AND status = 'succeeded'", queue) == 16
    assert peak and all(n == 1 for n in peak.values()), peak
    assert held_external and all(n == 1 for n in held_external), held_external
    assert pg.one("SELECT value FROM flow.stats WHERE name = 'group_limited'") > 0
    assert any(line.startswith("flow_group_limited_total ") for (line,) in pg.all("SELECT line FROM flow.prometheus"))
    # and the groups ran side by side: one group's limit did not hold up the others
    spans = pg.all("SELECT grp, began, ended FROM app.ran WHERE queue = %s ORDER BY began", queue)
    assert any(a[0] != b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:])), spans
    # within a group, one at a time
    for group in ("a", "b", "c"):
        mine = [s for s in spans if s[0] == group]
        assert all(later[1] >= earlier[2] for earlier, later in zip(mine, mine[1:])), mine


def test_a_childs_group_comes_from_spawn(pg):
    queue, child = grouped_queue(pg, group_concurrency=1)
    fan = unique("fan")
    pg.one(f"SELECT flow.define('{fan}', 'app.fan(jsonb, flow.context)'::regprocedure)")
    run = pg.one("SELECT flow.enqueue(%s, jsonb_build_object('child', %s::text, 'groups', '[\"x\", \"y\"]'::jsonb))",
                 fan, child)
    pg.wait_for("SELECT count(*) = 2 FROM flow.commands WHERE run_id = %s AND queue = %s", run, queue)
    assert sorted(pg.all("SELECT key, group_key FROM flow.commands WHERE run_id = %s AND queue = %s", run, queue)) \
        == [("x", "x"), ("y", "y")]
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false)", queue)
    assert pg.await_run(run)[0] == "succeeded"


def test_bad_groups_are_refused_and_change_nothing(pg):
    queue, name = grouped_queue(pg)
    before = pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s", queue)
    assert pg.sqlstate("SELECT flow.enqueue(%s, group_key => '')", name) == "FL002"
    assert pg.sqlstate("SELECT flow.enqueue(%s, group_key => repeat('x', 2000))", name) == "FL002"
    assert pg.sqlstate("SELECT flow.enqueue_many(%s, ARRAY['{}'::jsonb, '{}'], group_keys => ARRAY['a'])", name) \
        == "FL003"
    assert pg.sqlstate("SELECT flow.enqueue_many(%s, ARRAY['{}'::jsonb], group_key => 'a', group_keys => ARRAY['a'])",
                       name) == "FL006"
    assert pg.sqlstate("SELECT flow.enqueue_many(%s, ARRAY['{}'::jsonb], group_keys => ARRAY[' '])", name) == "FL002"
    # (the first bad key of many is named)
    with pg.connect() as c:
        for keys, says in (("ARRAY['a', NULL, 'b', '']", "group_keys[4] must not be empty"),
                           ("ARRAY['a', repeat('x', 1025), '']", "group_keys[2] is 1025 bytes")):
            with pytest.raises(psycopg.Error) as caught:
                c.execute(f"SELECT flow.enqueue_many(%s, array_fill('{{}}'::jsonb, ARRAY[cardinality({keys})]),"
                          f" group_keys => {keys})", (name,))
            assert caught.value.sqlstate == "FL002" and says in str(caught.value), str(caught.value)
    assert pg.sqlstate("SELECT flow.set_queue(%s, group_concurrency => 0)", queue) == "FL009"
    assert pg.one("SELECT count(*) FROM flow.commands WHERE queue = %s", queue) == before
    assert pg.one("SELECT group_concurrency FROM flow.queues WHERE name = %s", queue) is None
    # another role cannot set a queue's group limit
    assert pg.sqlstate("SELECT flow.set_queue(%s, group_concurrency => 1000)", queue, user="mallory") == "FL011"


def test_set_queue_keeps_the_group_limit_it_is_not_given(pg):
    queue, _ = grouped_queue(pg, group_concurrency=2)
    priorities_noted(pg)
    pg.one("SELECT flow.set_queue(%s, paused => false, concurrency => 5)", queue)
    pg.one("SELECT flow.set_queue(%s, rate => 10)", queue)
    assert pg.one("SELECT (concurrency, group_concurrency, rate)::text FROM flow.queues WHERE name = %s", queue) \
        == "(5,2,10)"
    pg.one("SELECT flow.set_queue(%s, group_concurrency => NULL)", queue)
    assert pg.one("SELECT group_concurrency FROM flow.queues WHERE name = %s", queue) is None
