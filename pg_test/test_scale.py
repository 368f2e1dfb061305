"""Plans on the hot path stay index driven whatever the tables' sizes: workers
that cached their plans while _commands was empty drain a large burst at full
speed, without one sequential scan of _commands (sql/common.sql, "Plans are
pinned by construction")."""
import time

import pytest

from conftest import fresh_cluster

BURST = 30_000


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2", "autovacuum = off")
    yield cluster
    cluster.stop()


def seq_scans(pg):
    return pg.one("SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'flow._commands'::regclass")


def test_plans_cached_on_an_empty_table_stay_index_driven_through_a_burst(pg):
    pg.one("SELECT flow.define('burst', 'flow.noop'::regproc, queue => 'burst')")
    pg.one("SELECT flow.define('probe', 'flow.noop'::regproc, queue => 'probe')")
    # the workers plan (and keep) their claim, settle and recovery statements on
    # an almost empty table: a handful of runs, more than 5 claims each (when
    # PL/pgSQL switches to a generic plan)
    for _ in range(20):
        run = pg.one("SELECT flow.enqueue('probe')")
        assert pg.await_run(run, "10s")[0] == "succeeded"
    time.sleep(1.5)   # a recovery round, a pass of pruning
    pg.one("SELECT flow.set_queue('burst', paused => true)")
    for _ in range(BURST // 1000):
        pg.one("SELECT cardinality(flow.enqueue_many('burst', array_fill('{}'::jsonb, array[1000])))")
    pg.all("SELECT pg_stat_force_next_flush()")
    before = seq_scans(pg)
    started = time.time()
    pg.one("SELECT flow.set_queue('burst', paused => false)")
    pg.wait_for(f"SELECT sum(value) >= {BURST + 20} FROM flow.stats WHERE name = 'runs_succeeded'", timeout=120)
    elapsed = time.time() - started
    time.sleep(2.5)   # the workers report their table statistics at most once a second
    assert seq_scans(pg) == before
    # a claim that scanned the table would take minutes for this burst (issue 9)
    assert elapsed < 60, f"{BURST} runs drained in {elapsed:.1f} s"
    assert pg.one("SELECT count(*) FROM flow.runs WHERE name = 'burst' AND status = 'succeeded'") == BURST
