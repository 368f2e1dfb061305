"""Rate limits: flow.set_queue(name, rate => n, per => interval) lets at most
n commands of the queue start per interval, counted in shared memory by
every claimant, in-database workers and external claims alike
(src/rate_limits.rs; sql/claim.sql, flow._claim)."""
import threading
import time

import pytest

from conftest import app_cluster, claim, external, unique

RATE_APP = """
    CREATE TABLE app.started (queue text, at timestamptz DEFAULT clock_timestamp(), who text);
    CREATE FUNCTION app.start(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE sql AS $$
        INSERT INTO app.started (queue, who) VALUES (ctx.queue, 'worker') RETURNING '{}'::jsonb
    $$;
"""


@pytest.fixture(scope="module")
def pg():
    cluster = app_cluster(RATE_APP)
    yield cluster
    cluster.stop()


def rated_queue(pg, rate, per="1 second"):
    queue, name = unique("rq"), unique("start")
    pg.one(f"SELECT flow.define('{name}', 'app.start'::regproc, queue => '{queue}')")
    pg.one("SELECT flow.set_queue(%s, rate => %s, per => %s::interval)", queue, rate, per)
    return queue, name


def test_a_rate_holds_across_two_workers_and_an_external_claimer(pg):
    queue, name = rated_queue(pg, 20)
    ext = external(pg, queue=f"'{queue}'")
    stop = threading.Event()
    external_starts = []

    def external_worker():
        with pg.connect() as conn:
            while not stop.is_set():
                for _ in claim(conn, ext, max_=5):
                    external_starts.append(time.time())
                time.sleep(0.01)   # (an external worker's polling interval)

    started = time.time()
    # The external claimer alone for a second, then the workers too: a worker
    # sleeps until the next cell and takes it at once, so a poller that came
    # second to every cell would prove nothing about sharing.
    pg.one("SELECT flow.enqueue_many(%s, array_fill('{}'::jsonb, ARRAY[200]))", ext)
    thread = threading.Thread(target=external_worker)
    thread.start()
    time.sleep(1.0)   # (the passage of time is what is measured: 3 s of a 20/s limit)
    pg.one("SELECT flow.enqueue_many(%s, array_fill('{}'::jsonb, ARRAY[200]))", name)
    time.sleep(2.0)
    stop.set()
    thread.join()
    elapsed = time.time() - started
    in_db = pg.one("SELECT count(*) FROM app.started WHERE queue = %s", queue)
    total = in_db + len(external_starts)
    # `rate` per second, evenly spaced (the cells of a tenth of a second at once at most): both
    # claimants share it
    allowed = 20 * elapsed + 20 / 10 + 1
    assert total <= allowed + 1, (in_db, len(external_starts), elapsed)
    assert total >= 20 * 2.5, (in_db, len(external_starts), elapsed)
    assert in_db > 0 and external_starts, "both kinds of claimant got commands"
    # no window of one second holds more than the rate
    rows = pg.all("SELECT at FROM app.started WHERE queue = %s ORDER BY at", queue)
    times = sorted([r[0].timestamp() for r in rows] + external_starts)
    for i, t in enumerate(times):
        in_window = sum(1 for u in times[i:] if u < t + 1.0)
        assert in_window <= 20 + 2 + 2, (t, in_window)   # (+2: a tenth of the rate; +2: two processes' clocks)


def test_rate_zero_starts_nothing_and_null_lifts_the_limit(pg):
    queue, name = rated_queue(pg, 0)
    run = pg.one("SELECT flow.enqueue(%s)", name)
    time.sleep(1.0)   # (time itself: nothing starts within 1 s)
    assert pg.one("SELECT count(*) FROM app.started WHERE queue = %s", queue) == 0
    pg.one("SELECT flow.set_queue(%s, rate => NULL)", queue)
    assert pg.await_run(run)[0] == "succeeded"


def test_set_queue_keeps_every_option_it_is_not_given(pg):
    queue, _ = rated_queue(pg, 7, "2 seconds")
    pg.one("SELECT flow.set_queue(%s, concurrency => 3)", queue)
    pg.one("SELECT flow.set_queue(%s, paused => true)", queue)
    assert pg.one("SELECT (concurrency, paused, rate, per)::text FROM flow.queues WHERE name = %s", queue) \
        == '(3,t,7,00:00:02)'
    pg.one("SELECT flow.set_queue(%s, paused => false, rate => 9)", queue)
    assert pg.one("SELECT (concurrency, paused, rate, per)::text FROM flow.queues WHERE name = %s", queue) \
        == '(3,f,9,00:00:02)'


def test_an_idle_worker_sleeps_until_the_next_cell(pg):
    queue, name = rated_queue(pg, 2, "1 second")
    pg.one("SELECT flow.enqueue_many(%s, array_fill('{}'::jsonb, ARRAY[6]))", name)
    pg.wait_for("SELECT count(*) = 6 FROM app.started WHERE queue = %s", queue, timeout=10)
    ats = [r[0] for r in pg.all("SELECT at FROM app.started WHERE queue = %s ORDER BY at", queue)]
    # one every half second, each close to its cell: no burst after the idle
    # spell. (The first cell may be a tenth of `per` in the past, src/rate_limits.rs's
    # tolerance: the first gap is then 0.4 s, give or take a few hundred
    # microseconds of the handlers' own clocks; 0.3995-0.3999 s failed 0.4.)
    gaps = [(b - a).total_seconds() for a, b in zip(ats, ats[1:])]
    assert all(0.39 <= g <= 0.7 for g in gaps), gaps
    claims = pg.one("SELECT value FROM flow.stats WHERE name = 'claims_empty'")
    assert claims is not None


def test_a_bad_rate_is_refused_and_changes_nothing(pg):
    queue, _ = rated_queue(pg, 5)
    before = pg.one("SELECT (rate, per)::text FROM flow.queues WHERE name = %s", queue)
    assert pg.sqlstate("SELECT flow.set_queue(%s, rate => -1)", queue) == "FL009"
    assert pg.sqlstate("SELECT flow.set_queue(%s, per => NULL)", queue) == "FL009"
    assert pg.sqlstate("SELECT flow.set_queue(%s, per => '-1 second')", queue) == "FL009"
    assert pg.sqlstate("SELECT flow.set_queue(%s, per => '0')", queue) == "FL009"
    assert pg.one("SELECT (rate, per)::text FROM flow.queues WHERE name = %s", queue) == before


def test_another_role_cannot_change_a_queues_rate(pg):
    queue, _ = rated_queue(pg, 5)
    pg.one("DO $$ BEGIN CREATE ROLE mallory LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    assert pg.sqlstate("SELECT flow.set_queue(%s, rate => 1000000)", queue, user="mallory") == "FL011"
    assert pg.one("SELECT rate FROM flow.queues WHERE name = %s", queue) == 5


def test_prometheus_counts_claims_a_rate_limit_cut_short(pg):
    lines = [r[0] for r in pg.all("SELECT line FROM flow.prometheus")]
    assert any(line.startswith("flow_rate_limited_total ") and int(line.split()[1]) > 0 for line in lines)
