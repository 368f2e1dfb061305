"""Plans on the hot path stay index driven whatever the tables' sizes: workers
that cached their plans while _commands was empty drain a large burst at full
speed, without one sequential scan of _commands (sql/common.sql, "Plans are
pinned by construction")."""
import time

import pytest

from conftest import fresh_cluster, own_cluster, poll

BURST = 30_000


@pytest.fixture(scope="module")
def pg():
    cluster = fresh_cluster("flow.workers = 2", "autovacuum = off")
    yield cluster
    cluster.stop()


def seq_scans(pg):
    return pg.one("SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'flow._commands'::regclass")


def entries_read(cluster, *tables):
    """Index entries of these tables (default: _runs and _commands) read so far."""
    cluster.all("SELECT pg_stat_force_next_flush()")
    return cluster.one("SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relid = ANY (%s::regclass[])",
                       list(tables or ("flow._runs", "flow._commands")))


def index_entries_read(cluster, *indexes):
    """Entries of these indexes read so far."""
    cluster.all("SELECT pg_stat_force_next_flush()")
    return cluster.one("SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE indexrelid = ANY (%s::regclass[])",
                       list(indexes))


def due_entries_read(c):
    """Entries of _commands_due read so far, as the statistics have them now."""
    c.execute("SELECT pg_stat_force_next_flush()")
    c.execute("SELECT pg_stat_clear_snapshot()")
    return c.execute("SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = '_commands_due'").fetchone()[0]


def test_claims_read_only_the_head_of_a_large_analyzed_backlog(pg):
    """(First in this module: the backlog is the whole table.) With the
    statistics of a large backlog, the generic plan of a claim (its
    LIMIT a parameter) could read every due command of the queue, sort them
    and lock the first few, on every claim; it reads the head only
    (sql/common.sql). Counted in index entries read by an external client's
    claims of 100 from 5,000 due commands, after ANALYZE (the size where this
    machine's planner took the bitmap scan)."""
    pg.one("SELECT flow.define('far', NULL, queue => 'far')")
    for _ in range(5):
        pg.one("SELECT cardinality(flow.enqueue_many('far', array_fill('{}'::jsonb, array[1000])))")
    pg.all("ANALYZE flow._commands")
    with pg.connect() as c:
        before = due_entries_read(c)
        for _ in range(5):
            claimed = c.execute("SELECT command_id FROM flow.claim(array['far'], 'test', 100)").fetchall()
            assert len(claimed) == 100
        read = due_entries_read(c) - before
    # the head: each claim's 100, and the entries of those claimed before it
    assert read < 3000, f"5 claims of 100 read {read} entries of _commands_due"


def test_a_drain_of_several_priorities_walks_each_emptied_one_once():
    """A worker's claims take up where the last one ended in each queue and
    priority (flow._claim's cursors). A claim that moved on to the next
    priority kept only that one's end, so every later claim walked the
    emptied priorities again from their heads, through the index entries of
    everything claimed from them (no VACUUM meanwhile): a drain of 5
    priorities claimed 15 % slower than one of a single priority. Counted in
    pages of _commands_due read by a drain of 4,000 in each of 5 priorities
    (7,500-8,600 then, 2,600 now; killed entries are not counted as entries
    read, but their pages are). (A cluster of its own: the entries it leaves
    would be in the way of the other tests' counts.)"""
    with own_cluster("/tmp/flow-it-priorities", 5491, "flow.workers = 2", "autovacuum = off") as pg:
        several_priorities_drain(pg)


def several_priorities_drain(pg):
    pg.one("SELECT flow.define('prio_drain', 'flow.noop'::regproc, queue => 'prio_drain')")
    pg.one("SELECT flow.set_queue('prio_drain', paused => true)")
    for k in range(20):
        pg.one("SELECT cardinality(flow.enqueue_many('prio_drain', array_fill('{}'::jsonb, array[1000]),"
               " priority => %s))", k % 5)
    with pg.connect() as c:
        before = due_blocks_read(c)
        pg.one("SELECT flow.set_queue('prio_drain', paused => false)")
        pg.wait_for("SELECT count(*) = 20000 FROM flow.runs WHERE name = 'prio_drain' AND status = 'succeeded'",
                    timeout=120)
        time.sleep(2.2)   # (the workers' reads reach the statistics at most once a second)
        read = due_blocks_read(c) - before
    assert read < 5000, f"a drain of 20,000 in 5 priorities read {read} pages of _commands_due"


def test_an_external_claim_reads_only_its_own_definitions_due_commands(pg):
    """A claim names its definitions: the due commands of other external
    definitions, in its queue or in another, are not in its way. Counted in
    index entries read by claims of 100 of one definition while another has
    a backlog of 20,000 in the same queue and one of 20,000 in another queue
    (a claim that walked them would read 40,000 entries or more)."""
    pg.one("SELECT flow.define('lone', NULL, queue => 'shared')")
    pg.one("SELECT flow.define('crowd', NULL, queue => 'shared')")
    pg.one("SELECT flow.define('crowd_elsewhere', NULL, queue => 'elsewhere')")
    for name in ("crowd", "crowd_elsewhere"):
        for _ in range(20):
            pg.one(f"SELECT cardinality(flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[1000])))")
    # due before the crowd's, and after: a claim of 'lone' meets the crowd either way
    pg.one("SELECT cardinality(flow.enqueue_many('lone', array_fill('{}'::jsonb, array[300])))")
    with pg.connect() as c:
        before = due_entries_read(c)
        for _ in range(3):
            claimed = c.execute("SELECT name FROM flow.claim(array['lone'], 'test', 100)").fetchall()
            assert claimed == [("lone",)] * 100
        assert c.execute("SELECT count(*) FROM flow.claim(array['lone'], 'test', 100)").fetchone()[0] == 0
        read = due_entries_read(c) - before
    assert read < 2000, f"4 claims of 'lone' read {read} entries of _commands_due"
    # the crowd is still all there, for claims that name it (both queues at once)
    with pg.connect() as c:
        claimed = c.execute("SELECT queue, count(*) FROM flow.claim(array['crowd', 'crowd_elsewhere'], 'test', 1000)"
                            " GROUP BY queue ORDER BY queue").fetchall()
    assert claimed == [("elsewhere", 500), ("shared", 500)]


def due_blocks_read(c):
    """Blocks of _commands_due read so far (killed entries are skipped
    without being counted as entries read, but their pages are read)."""
    c.execute("SELECT pg_stat_force_next_flush()")
    c.execute("SELECT pg_stat_clear_snapshot()")
    return c.execute("SELECT idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes"
                     " WHERE indexrelname = '_commands_due'").fetchone()[0]


def test_external_claims_take_up_where_the_last_full_claim_of_their_definition_ended(pg):
    """The due-index entries of commands claimed before stay at the head of
    their definition's range until VACUUM (off here, as between two
    autovacuums of a busy table), and a claim from the head reads every page
    of them. External claims of one definition take up where the last full
    claim of it ended, whichever client made it (flow.claim,
    src/external.rs): counted in pages of _commands_due read by 10 claims of
    100 after 6,000 were claimed and completed: 23 here when no claim of
    them starts from the head again, 483 when every claim does (the queue's
    head probe and the claim itself each walk the pages of the 6,000
    entries). Once the 250 ms after the first full claim are over, one claim
    starts from the head again (about 50 pages): a slow machine may see a few."""
    pg.one("SELECT flow.define('walked', NULL, queue => 'walked')")
    for _ in range(10):
        pg.one("SELECT cardinality(flow.enqueue_many('walked', array_fill('{}'::jsonb, array[1000])))")
    # (the in-database workers' own looks at their queues' heads read pages
    # of the same index: they are paused meanwhile)
    with pg.engine_paused():
        claims_take_up_where_the_last_ended(pg)


def claims_take_up_where_the_last_ended(pg):
    with pg.connect() as first, pg.connect() as second:
        def claim_and_complete(c):
            claimed = c.execute("SELECT command_id, lease_token FROM flow.claim(array['walked'], 'test', 100)").fetchall()
            assert len(claimed) == 100
            done = c.execute("SELECT count(*) FROM flow.complete_many(%s, %s) WHERE status = 'succeeded'",
                             ([r[0] for r in claimed], [r[1] for r in claimed])).fetchone()[0]
            assert done == 100
        for i in range(60):
            claim_and_complete((first, second)[i % 2])
        before = due_blocks_read(first)
        started = time.monotonic()
        for i in range(10):
            claim_and_complete((first, second)[i % 2])
        took = time.monotonic() - started
        read = due_blocks_read(first) - before
    # (one start from the head per 250 ms the claims took, ~50 pages each:
    # a machine busy with something else may stretch them; seen at 300 in
    # two full runs of the suite)
    # (and a loaded machine's in-database workers look at their heads more:
    # a CI run read 341; without the cursor, 10 claims read thousands)
    allowed = max(400, 60 * (took / 0.25 + 1))
    assert read < allowed, f"10 claims of 100 read {read} pages of _commands_due in {took:.2f} s"
    assert pg.one("SELECT count(*) FROM flow.commands WHERE name = 'walked' AND status = 'succeeded'") == 7000


def test_plans_cached_on_an_empty_table_stay_index_driven_through_a_burst(pg):
    pg.one("SELECT flow.define('burst', 'flow.noop'::regproc, queue => 'burst')")
    pg.one("SELECT flow.define('probe', 'flow.noop'::regproc, queue => 'probe')")
    # the workers plan (and keep) their claim, settle and recovery statements on
    # an almost empty table: a handful of runs, more than 5 claims each (when
    # PL/pgSQL switches to a generic plan)
    for _ in range(20):
        run = pg.one("SELECT flow.enqueue('probe')")
        assert pg.await_run(run, "10s")[0] == "succeeded"
    time.sleep(1.5)   # (time itself:) a recovery round, a pass of pruning
    pg.one("SELECT flow.set_queue('burst', paused => true)")
    for _ in range(BURST // 1000):
        pg.one("SELECT cardinality(flow.enqueue_many('burst', array_fill('{}'::jsonb, array[1000])))")
    pg.all("SELECT pg_stat_force_next_flush()")
    before = seq_scans(pg)
    started = time.time()
    pg.one("SELECT flow.set_queue('burst', paused => false)")
    pg.wait_for(f"SELECT sum(value) >= {BURST + 20} FROM flow.stats WHERE name = 'runs_succeeded'", timeout=120)
    elapsed = time.time() - started
    time.sleep(2.5)   # (time itself:) the workers report their table statistics at most once a second
    assert seq_scans(pg) == before
    # a claim that scanned the table would take minutes for this burst (issue 9)
    assert elapsed < 60, f"{BURST} runs drained in {elapsed:.1f} s"
    assert pg.one("SELECT count(*) FROM flow.runs WHERE name = 'burst' AND status = 'succeeded'") == BURST


def test_settlements_planned_when_nothing_ran_stay_driven_by_their_commands_through_a_burst(pg):
    """A settlement joins the commands it settles to _commands. Planned while
    the table was small (and its statistics said it was empty), the join
    could read every due command, through the claim's partial index, for each
    chunk: once the same plan met a burst of a million, each settlement read
    them all (a full benchmark finished nothing for 40 s, then 3 runs a second,
    until autovacuum analyzed the tables again). Counted in index entries
    read: the settlements look up what they settle."""
    pg.one("SELECT flow.define('calm', 'flow.noop'::regproc, queue => 'calm')")
    pg.one("SELECT flow.define('wave', 'flow.noop'::regproc, queue => 'wave')")
    for _ in range(2):
        pg.one("SELECT cardinality(flow.enqueue_many('calm', array_fill('{}'::jsonb, array[1000])))")
    pg.wait_for("SELECT count(*) = 0 FROM flow.runs WHERE name = 'calm' AND status = 'running'", timeout=60)
    pg.all("ANALYZE flow._runs")
    pg.all("ANALYZE flow._commands")
    for _ in range(20):   # more than 5 settlements each: PL/pgSQL's generic plans
        run = pg.one("SELECT flow.enqueue('calm')")
        assert pg.await_run(run, "10s")[0] == "succeeded"
    pg.one("SELECT flow.set_queue('wave', paused => true)")
    wave = 20_000
    for _ in range(wave // 1000):
        pg.one("SELECT cardinality(flow.enqueue_many('wave', array_fill('{}'::jsonb, array[1000])))")

    before = entries_read(pg)
    pg.one("SELECT flow.set_queue('wave', paused => false)")
    # (polled by a scan of the commands: flow.runs reads an index entry per
    # run at each poll, which this test would count)
    pg.wait_for("SELECT count(*) = 0 FROM flow._commands WHERE name = 'wave' AND finished_at IS NULL", timeout=300)
    time.sleep(2.5)   # (time itself:) the workers report their table statistics at most once a second
    read = entries_read(pg) - before
    # each run: its claim, its settlement, a few lookups; a scan per chunk would be tens of millions
    assert read < 10 * wave, f"draining {wave} runs read {read:,} index entries of _runs and _commands"


def test_claims_of_a_steady_flow_take_up_where_the_last_one_ended():
    """Under a steady flow each claim comes back short (it takes all that is
    due), and the next one takes up where it ended (src/worker.rs, claim), so
    it does not walk, at its queue's head, the due-index entries of every
    command claimed since the last VACUUM (off here): counted in pages of
    _commands_due read while 31 runs are enqueued one at a time and awaited,
    after 20,000 were drained (about 11,000 when each claim, its queue-head
    probe and the idle worker's look for the next due time start at the head:
    120 pages each). A run enqueued by a transaction that began before those 30
    is due behind where the claims took up: its commit says so
    (shmem::DueFloors), so it is claimed at once, not when the cursor runs
    out (CURSOR_SPAN, 1 s). (A cluster of its own: the workers' look at every
    queue's head, and the queues of the tests before it hold the index
    entries of hundreds of thousands of commands.)"""
    with own_cluster("/tmp/flow-it-steady", 5492, "flow.workers = 2", "autovacuum = off") as pg:
        steady_flow(pg)


def steady_flow(pg):
    pg.one("SELECT flow.define('steady', 'flow.noop'::regproc, queue => 'steady')")
    # (enqueued while paused, so that the drain leaves whole index pages of
    # entries behind at the queue's head, as a churn does between autovacuums)
    pg.one("SELECT flow.set_queue('steady', paused => true)")
    pg.one("SELECT cardinality(flow.enqueue_many('steady', array_fill('{}'::jsonb, array[20000])))")
    pg.one("SELECT flow.set_queue('steady', paused => false)")
    pg.wait_for("SELECT count(*) = 20000 FROM flow.runs WHERE name = 'steady' AND status = 'succeeded'", timeout=120)
    with pg.connect() as c, pg.connect() as late:
        late.execute("BEGIN")
        late.execute("SELECT now()")   # its enqueue will be due at this time
        # (time itself: the workers' reads reach the statistics at most once a
        # second, at a transaction of theirs: an idle worker makes one every poll interval)
        time.sleep(2.2)
        before = due_blocks_read(c)
        for _ in range(30):
            run = c.execute("SELECT flow.enqueue('steady')").fetchone()[0]
            assert c.execute("SELECT status FROM flow.await(%s, '10s')", (run,)).fetchone()[0] == "succeeded"
        # (at once, while the claims take up where the last one ended)
        run = late.execute("SELECT flow.enqueue('steady')").fetchone()[0]
        late.execute("COMMIT")
        committed = time.monotonic()
        assert c.execute("SELECT status FROM flow.await(%s, '10s')", (run,)).fetchone()[0] == "succeeded"
        waited = time.monotonic() - committed
        time.sleep(2.2)   # (time itself: as above)
        read = due_blocks_read(c) - before
    # (2,000-3,200 seen here, with the engines before and after this bound was
    # raised from 3,000; about 11,000 from the heads)
    assert read < 5000, f"31 runs, one at a time, read {read} pages of _commands_due"
    assert waited < 0.5, f"a run due behind where the claims took up waited {waited:.2f} s"


def test_a_command_due_behind_where_claims_take_up_is_not_left_until_the_backlog_ends(pg):
    """While a backlog drains, each claim takes up where the worker's last one
    ended (flow._claim): a command that becomes due behind that point (here,
    enqueued by a transaction that began before the backlog was enqueued, so
    its due time is older) is still claimed within a fraction of a second,
    not only when the backlog is gone."""
    backlog = 120_000
    pg.one("SELECT flow.define('backlog', 'flow.noop'::regproc, queue => 'backlog')")
    pg.one("SELECT flow.set_queue('backlog', paused => true)")
    with pg.connect() as late:
        late.execute("BEGIN")
        late.execute("SELECT now()")   # its enqueue will be due at this time
        for _ in range(backlog // 1000):
            pg.one("SELECT cardinality(flow.enqueue_many('backlog', array_fill('{}'::jsonb, array[1000])))")
        succeeded = "SELECT value FROM flow.stats WHERE name = 'runs_succeeded'"
        drained_from = pg.one(succeeded)
        pg.one("SELECT flow.set_queue('backlog', paused => false)")
        # (the drain under way: a tenth of the backlog done, the claims taking up well past the head)
        pg.wait_for(f"SELECT ({succeeded}) >= %s", drained_from + backlog // 10)
        run = late.execute("SELECT flow.enqueue('backlog', '{\"late\": true}')").fetchone()[0]
        late.execute("COMMIT")
    pg.wait_for(f"SELECT count(*) = {backlog + 1} FROM flow.runs WHERE name = 'backlog' AND status = 'succeeded'",
                timeout=180)
    finished = pg.one("SELECT finished_at FROM flow.runs WHERE id = %s", run)
    after = pg.one("SELECT count(*) FROM flow.runs WHERE name = 'backlog' AND finished_at > %s", finished)
    # claimed at its commit (its due time is before where the claims take up:
    # shmem::DueFloors), early in a drain of several seconds
    assert after > backlog // 4, f"only {after} of {backlog} backlog runs finished after the late one"


def test_a_runs_commands_are_found_by_index_among_many(pg):
    """A run's root command has the run's id, its other commands are indexed
    by (run_id, key) (sql/schema.sql): the views filtered by run, a cancel and
    a run graph read no sequential scan of _commands on a table of 170,000
    analyzed commands (after the tests above), and neither does pruning (a
    lateral join to flow._commands_of read all of _commands per batch)."""
    pg.one("SELECT flow.set_queue('probe', paused => true)")
    run = pg.one("SELECT flow.enqueue('probe')")
    done = pg.one("SELECT id FROM flow._run_rows WHERE name = 'burst' LIMIT 1")
    pg.all("ANALYZE flow._commands")
    pg.all("SELECT pg_stat_force_next_flush()")
    before = seq_scans(pg)
    assert pg.all("SELECT id, key, status FROM flow.commands WHERE run_id = %s", run) == [(run, "root", "pending")]
    assert pg.all("SELECT outcome FROM flow.attempts WHERE run_id = %s", done) == [("succeeded",)]
    assert pg.one("SELECT attempts FROM flow.runs WHERE id = %s", done) == 1
    assert pg.all("SELECT * FROM flow.waits WHERE run_id = %s", done) == []
    assert "root: burst v1" in pg.one("SELECT flow.run_graph(%s)", done)
    pg.one("SELECT flow.cancel(%s)", run)
    assert pg.one("SELECT status FROM flow.commands WHERE run_id = %s", run) == "cancelled"
    pg.all("SELECT pg_stat_force_next_flush()")
    assert seq_scans(pg) == before
    # a window of 100 runs from a finished one on (flow._prune takes runs after its third argument)
    after = pg.one("SELECT id FROM flow._run_rows WHERE id < %s ORDER BY id DESC LIMIT 1", done)
    pruned = pg.one("SELECT pruned FROM flow._prune('0 s', 100, %s)", after)
    pg.all("SELECT pg_stat_force_next_flush()")
    assert seq_scans(pg) == before
    assert pruned >= 1
    assert pg.one("SELECT count(*) FROM flow._commands WHERE run_id = %s", done) == 0


def test_a_settlement_learns_whether_its_run_has_children_left_by_one_probe(pg):
    """Whether a run has unfinished children is a probe of
    _commands_open_children (sql/schema.sql), however many have finished:
    through _commands_run_key each settlement read the finished children
    before the first unfinished one in key order, under the run's lock (2.3 ms
    a settlement when 4,000 children of one run were half done). Counted in
    entries of those two indexes read while 300 children, completed in key
    order by an external worker, end their run: 46,000 before, 1,200 now (with
    its entries deduplicated, one posting list per run that no scan could mark
    dead until all its children had finished: 16,000)."""
    pg.all("""CREATE FUNCTION public.many_kids(args jsonb) RETURNS void LANGUAGE plpgsql AS $$
              BEGIN
                  FOR i IN 1..300 LOOP
                      PERFORM flow.spawn('kid', key => 'k' || lpad(i::text, 4, '0'));
                  END LOOP;
              END $$""")
    pg.one("SELECT flow.define('kid', NULL, queue => 'kids')")
    pg.one("SELECT flow.define('many_kids', 'public.many_kids'::regproc, queue => 'kids_root')")
    run = pg.one("SELECT flow.enqueue('many_kids')")
    poll(lambda: pg.one("SELECT count(*) FROM flow.commands WHERE run_id = %s AND name = 'kid'", run) == 300,
         what="the 300 children")
    before = index_entries_read(pg, "flow._commands_run_key", "flow._commands_open_children")
    with pg.connect() as c:
        for _ in range(300):
            command, token = c.execute("SELECT command_id, lease_token FROM flow.claim(array['kid'], 'test', 1)").fetchone()
            assert c.execute("SELECT flow.complete(%s, %s)", (command, token)).fetchone()[0] == "succeeded"
    read = index_entries_read(pg, "flow._commands_run_key", "flow._commands_open_children") - before
    assert pg.one("SELECT status FROM flow.runs WHERE id = %s", run) == "succeeded"
    assert read < 3000, f"300 settlements of one run's children read {read} entries"


def test_event_retention_finds_the_waits_of_an_event_by_index(pg):
    """flow._retire_events keeps the events a wait refers to: it looks for
    such waits, and the foreign key's check of each deletion does too,
    through _waits_event, never by reading all of _waits (per event: a pass
    took 153 s for 5,000 events beside 300,000 waits)."""
    with pg.connect() as c:
        c.execute("INSERT INTO flow._waits (command_id, name, key) SELECT gen_random_uuid(), 'retire_probe', 'k' || g"
                  " FROM generate_series(1, 20000) g")
        old = "INSERT INTO flow._events (id, name, key, payload, owner, emitted_at)" \
              " SELECT gen_random_uuid(), 'retire_old', 'k' || g, '{}', 'postgres', now() - interval '2 days'" \
              " FROM generate_series(1, %s) g RETURNING position"
        kept = c.execute(old, (1,)).fetchone()[0]
        c.execute("INSERT INTO flow._waits (command_id, name, key, event_position, satisfied_at)"
                  " VALUES (gen_random_uuid(), 'retire_old', 'k1', %s, now())", (kept,))
        c.execute(old, (2000,))
        c.execute("ANALYZE flow._waits")
        c.execute("SELECT pg_stat_force_next_flush()")
        scans = "SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'flow._waits'::regclass"
        before = c.execute(scans).fetchone()[0]
        assert c.execute("SELECT flow._retire_events('1 day', 100000)").fetchone()[0] == 2000
        c.execute("SELECT pg_stat_force_next_flush()")
        c.execute("SELECT pg_stat_clear_snapshot()")
        assert c.execute(scans).fetchone()[0] == before
        assert c.execute("SELECT count(*) FROM flow._events WHERE name = 'retire_old'").fetchone()[0] == 1
        assert c.execute("SELECT position FROM flow._events WHERE name = 'retire_old'").fetchone()[0] == kept
        c.execute("DELETE FROM flow._waits WHERE name IN ('retire_probe', 'retire_old')")


def test_workers_draining_one_queue_claim_after_what_the_others_hold():
    """Commands a worker's chunk holds are locked until it commits, and a
    claim skips locked rows (SKIP LOCKED) only after reading each one: a claim
    that started at the head of its queue would read the batches all the
    other workers hold, so the index entries of _commands read per run grew
    with the number of workers. While a backlog drains, the workers share
    where their claims ended (src/shmem.rs, publish_cursor) and each takes up
    after the others. Counted while six workers drain a backlog: three
    stretches of 15,000 runs each, the queue paused after each, the median
    of their entries read per run (measured: medians 6.5-7.2 with the
    sharing; 9.3 and 9.9 in two of three runs of a build without it, under 9
    in the third; single stretches reach 11.5 now and then, hence the
    median). A stretch stops before the backlog runs out: when it does, each
    worker's next claims walk back from the queue's head over the entries of
    everything drained (dead, but not yet skippable while the other workers'
    transactions are open), a cost of its own that made a whole drain's
    figure swing from 6.5 to 11.4. The backlog still drains completely.
    (A cluster of its own, beside the module's: fresh_cluster would replace
    that one.)"""
    with own_cluster("/tmp/flow-it-six", 5494, "flow.workers = 6") as cluster:
        # (a stretch ends with the chunks the workers hold when the queue is
        # paused: up to six claims of 1,000 past it, so the backlog keeps
        # what three such stretches take, and some)
        backlog, stretch = 90_000, 15_000
        cluster.one("SELECT flow.define('shared', 'flow.noop'::regproc, queue => 'shared')")
        cluster.one("SELECT flow.set_queue('shared', paused => true)")
        for _ in range(backlog // 1000):
            cluster.one("SELECT cardinality(flow.enqueue_many('shared', array_fill('{}'::jsonb, array[1000])))")
        finished = "SELECT sum(value) FROM flow.stats WHERE name IN ('runs_succeeded', 'runs_failed')"
        per_run = []
        time.sleep(1.5)   # (time itself:) what the workers read while idle is reported first
        with cluster.connect() as c:
            for _ in range(3):
                entries_before, finished_before = entries_read(cluster, "flow._commands"), c.execute(finished).fetchone()[0]
                c.execute("SELECT flow.set_queue('shared', paused => false)")
                poll(lambda: c.execute(finished).fetchone()[0] - finished_before >= stretch, timeout=60,
                     interval=0.005, what=f"a stretch of {stretch} to finish (after {per_run})")
                c.execute("SELECT flow.set_queue('shared', paused => true)")
                time.sleep(2.5)   # (time itself:) the workers finish their chunks and report their statistics (at most once a second)
                drained = c.execute(finished).fetchone()[0] - finished_before
                per_run.append((entries_read(cluster, "flow._commands") - entries_before) / drained)
        cluster.one("SELECT flow.set_queue('shared', paused => false)")
        cluster.wait_for("SELECT count(*) = 0 FROM flow._commands WHERE name = 'shared' AND finished_at IS NULL",
                         timeout=300)
        assert cluster.one("SELECT count(*) FROM flow._commands WHERE name = 'shared' AND status = 'succeeded'") == backlog
        assert sorted(per_run)[1] < 9, \
            f"{sorted(per_run)} index entries of _commands read per run in three stretches drained by six workers"


def test_plans_made_while_the_tables_are_counted_empty_stay_driven_by_their_commands():
    """After a quiet spell, VACUUM ANALYZE leaves _commands and _runs counted
    empty, and an idle worker plans its claim and settlement again after any
    ANALYZE (worker.rs, warm_plans), so they are planned then: a scan of a
    table counted empty looks free, and a join of the commands a claim,
    settlement or completion handles to _commands (or their runs to _runs)
    could be planned as a scan of the whole table with the list inside, read
    once per command (a drain of 20,000 ran at 4,000 runs/s, each settlement
    of 500 taking 2.3 s). The joins are written so that only a probe per
    command can be planned (sql/common.sql). Counted in index entries read by
    a burst drained by workers (held and leased claims) and by an external
    client. (A cluster of its own: the test empties flow's tables.)"""
    with own_cluster("/tmp/flow-it-empty", 5493, "flow.workers = 2", "autovacuum = off") as cluster:
        cluster.all("""
            CREATE SCHEMA app;
            CREATE FUNCTION app.quiet(args jsonb) RETURNS void LANGUAGE plpgsql AS $$ BEGIN END $$;
            SELECT flow.define('quiet_rust', 'flow.noop'::regproc, queue => 'quiet');
            SELECT flow.define('quiet_sql', 'app.quiet'::regproc, queue => 'quiet');
            SELECT flow.define('quiet_ext', NULL, queue => 'quiet_ext');""")
        for name in ("quiet_rust", "quiet_sql"):
            assert cluster.await_run(cluster.one(f"SELECT flow.enqueue('{name}')"), "10s")[0] == "succeeded"
        cluster.all("TRUNCATE flow._runs, flow._commands, flow._attempts, flow._waits")
        cluster.all("VACUUM ANALYZE flow._runs")
        cluster.all("VACUUM ANALYZE flow._commands")
        time.sleep(2.5)   # (time itself:) idle workers plan their claim and settlement again (flow.poll_interval: 1 s)
        burst = 10_000
        cluster.one("SELECT flow.set_queue('quiet', paused => true)")
        for name in ("quiet_rust", "quiet_sql", "quiet_ext"):
            for _ in range(burst // 1000):
                cluster.one(f"SELECT cardinality(flow.enqueue_many('{name}', array_fill('{{}}'::jsonb, array[1000])))")

        time.sleep(1.5)   # (time itself:) what the workers read while idle is reported first
        before = entries_read(cluster)
        cluster.one("SELECT flow.set_queue('quiet', paused => false)")
        with cluster.connect() as c:
            completed = 0
            while True:
                claimed = c.execute("SELECT command_id, lease_token FROM flow.claim(array['quiet_ext'], 'test', 100)").fetchall()
                if not claimed:
                    break
                completed += c.execute("SELECT count(*) FROM flow.complete_many(%s, %s) WHERE status = 'succeeded'",
                                       ([r[0] for r in claimed], [r[1] for r in claimed])).fetchone()[0]
        assert completed == burst
        cluster.wait_for("SELECT count(*) = 0 FROM flow._commands WHERE finished_at IS NULL", timeout=300)
        time.sleep(2.5)   # (time itself:) the workers report their table statistics at most once a second
        per_run = (entries_read(cluster) - before) / (3 * burst)
        assert cluster.one("SELECT count(*) FROM flow._commands WHERE status = 'succeeded'") == 3 * burst
        assert per_run < 20, f"{per_run:.2f} index entries of _runs and _commands read per run"
