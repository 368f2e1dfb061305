"""Schedules (sql/schedules.sql, src/schedules.rs, src/maintenance.rs): each
tick of a schedule's cron, in its time zone, is a run enqueued by the
maintenance worker as the schedule's owner, keyed
schedule:<name>:<tick in UTC>. Ticks fire once and on time; ticks missed while
the server was down are skipped, except the last `catch_up` of them;
overlap => false skips a tick while the last tick's run is unfinished; a
schedule is its owner's alone.

Times: the ticks here are every second (6-field cron), so a test waits a few
seconds for its runs; the DST rules are checked without waiting, on fixed
instants (flow._cron_next, flow._schedule_due)."""
import re
import time
from datetime import datetime, timedelta, timezone

import pytest

from conftest import app_cluster, poll, unique

EVERY_SECOND = "* * * * * *"
SECOND = timedelta(seconds=1)

SCHEDULE_APP = """
    DO $$ BEGIN CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN;
    EXCEPTION WHEN duplicate_object THEN NULL; END $$;
    GRANT USAGE ON SCHEMA app TO PUBLIC;
    -- each handler execution: when it began and ended (clock time), and as whom
    CREATE TABLE app.ticks (run_id uuid, tag text, began timestamptz, ended timestamptz, who text);
    GRANT ALL ON app.ticks TO PUBLIC;

    CREATE FUNCTION app.tick(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
    DECLARE
        began timestamptz := clock_timestamp();
    BEGIN
        IF args ? 'sleep' THEN PERFORM pg_sleep((args->>'sleep')::float); END IF;
        INSERT INTO app.ticks VALUES (ctx.run_id, args->>'tag', began, clock_timestamp(), current_user);
        RETURN jsonb_build_object('tag', args->>'tag', 'attempt', ctx.attempt);
    END $$;
    SELECT flow.define('tick', 'app.tick'::regproc, max_attempts => 3, backoff => '10 ms');
"""


@pytest.fixture(scope="module")
def pg():
    cluster = app_cluster(SCHEDULE_APP, conf=("flow.workers = 4",))
    cluster.all("SELECT flow.define('alice_tick', 'app.tick'::regproc, max_attempts => 3, backoff => '10 ms')",
                user="alice")
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def no_schedules_left(pg):
    """Each test starts with no schedule and leaves none (each is removed by its owner)."""
    yield
    for owner, name in pg.all("SELECT owner::text, name FROM flow.schedules"):
        assert pg.one("SELECT flow.unschedule(%s)", name, user=owner) is True
    assert pg.one("SELECT count(*) FROM flow._schedules") == 0


# ---------------------------------------------------------------- helpers

KEY_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def tick_of(key, name):
    """The tick a run key names (schedule:<name>:<YYYY-MM-DDTHH:MM:SSZ>), checking its form."""
    prefix = f"schedule:{name}:"
    assert key.startswith(prefix), key
    stamp = key[len(prefix):]
    assert KEY_TIME.match(stamp), key
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def runs_of(pg, name, user="postgres", owner=None):
    """The runs of schedule `name` that `user` sees (of `owner`'s schedule, if
    given), by tick: dicts of tick, id, status, result, created_at, owner, key."""
    rows = pg.all("SELECT key, id, status, result, created_at, owner::text FROM flow.runs"
                  " WHERE left(key, length(%s)) = %s AND (%s::text IS NULL OR owner::text = %s)",
                  f"schedule:{name}:", f"schedule:{name}:", owner, owner, user=user)
    runs = [dict(tick=tick_of(key, name), id=run, status=status, result=result, created_at=created, owner=who,
                 key=key) for key, run, status, result, created, who in rows]
    return sorted(runs, key=lambda r: r["tick"])


def count_runs(pg, name, user="postgres"):
    return pg.one("SELECT count(*) FROM flow.runs WHERE left(key, length(%s)) = %s",
                  f"schedule:{name}:", f"schedule:{name}:", user=user)


def wait_runs(pg, name, count, user="postgres", timeout=30.0):
    """Wait until schedule `name` has at least `count` runs; returns them."""
    poll(lambda: count_runs(pg, name, user) >= count, timeout, 0.05, f"{count} runs of schedule {name}")
    return runs_of(pg, name, user)


def consecutive(ticks, step=SECOND):
    return all(b - a == step for a, b in zip(ticks, ticks[1:]))


def counter(pg, name):
    return pg.one("SELECT value FROM flow.stats WHERE name = %s", name)


def schedule_row(pg, name, user="postgres"):
    rows = pg.all("SELECT cron, timezone, definition, args, queue, paused, next_tick, last_tick, last_run_id,"
                  " owner::text, overlap, catch_up FROM flow.schedules WHERE name = %s", name, user=user)
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def wait_finished(pg, names, timeout=30.0):
    """Wait until no run of these schedules is unfinished."""
    pg.wait_for("SELECT NOT EXISTS (SELECT 1 FROM flow._run_rows WHERE status = 'running'"
                " AND split_part(key, ':', 2) = ANY (%s))", list(names), timeout=timeout)


def handler_spans(pg, tag):
    """(began, ended) of each handler execution of args tag `tag`, by start."""
    return pg.all("SELECT began, ended FROM app.ticks WHERE tag = %s ORDER BY began", tag)


# ---------------------------------------------------------------- 1. firing

def test_every_second_ticks_fire_once_each_on_time_with_their_keys(pg):
    name = unique("every")
    fired_before = counter(pg, "ticks_fired")
    first, at = pg.all(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text)),"
                       " now()", name, name)[0]
    # the first tick strictly after now(), on a whole second
    assert at < first <= at + SECOND and first.microsecond == 0
    row = schedule_row(pg, name)
    assert row[:6] == (EVERY_SECOND, "UTC", "tick", {"tag": name}, None, False)
    # (the first tick may be enqueued already, up to a second ahead of its time)
    assert first <= row[6] <= first + 2 * SECOND and row[7] in (None, row[6] - SECOND)
    assert row[9:] == ("postgres", True, 0)

    wait_runs(pg, name, 4)
    assert pg.one("SELECT flow.pause_schedule(%s)", name) is True
    wait_finished(pg, [name])
    runs = runs_of(pg, name)
    ticks = [r["tick"] for r in runs]
    # each tick once (no two runs of a tick), from the first tick on, none left out
    assert ticks[0] == first
    assert len(set(ticks)) == len(ticks) and consecutive(ticks)
    assert [r["key"] for r in runs] == [f"schedule:{name}:{t:%Y-%m-%dT%H:%M:%SZ}" for t in ticks]
    # each a run of the handler, owned by the schedule's owner, that succeeded with its result
    for r in runs:
        assert (r["status"], r["result"], r["owner"]) == ("succeeded", {"tag": name, "attempt": 1}, "postgres")
    assert pg.one("SELECT count(*) FROM app.ticks WHERE tag = %s", name) == len(runs)
    assert pg.one("SELECT count(DISTINCT run_id) FROM app.ticks WHERE tag = %s", name) == len(runs)
    # the schedule remembers its last tick and that tick's run
    row = schedule_row(pg, name)
    assert (row[7], row[8]) == (ticks[-1], runs[-1]["id"])
    # on time: each run was enqueued ahead of its tick (at most a second), and
    # its handler began at the tick, not before
    ahead = [(r["tick"] - r["created_at"]).total_seconds() for r in runs]
    assert all(-0.5 < x <= 1.05 for x in ahead), ahead
    began = dict(pg.all("SELECT run_id, began FROM app.ticks WHERE tag = %s", name))
    lateness = [(began[r["id"]] - r["tick"]).total_seconds() for r in runs]
    print(f"\nschedule lateness (s): {['%.4f' % x for x in lateness]}")
    assert all(0 <= x < 0.5 for x in lateness), lateness
    pg.wait_for("SELECT value >= %s FROM flow.stats WHERE name = 'ticks_fired'", fired_before + len(runs))


def test_a_replace_in_an_older_transaction_runs_no_tick_twice(pg):
    """flow.schedule computes the next tick from the clock and the last tick
    enqueued, not from its transaction's start: a replace in a transaction
    older than ticks the schedule already fired goes on after them, and no
    tick is fired twice (nothing refused by its key, nothing skipped)."""
    name = unique("rewind")
    skipped_before = counter(pg, "ticks_skipped")
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text))",
           name, f"{name}:1")
    with pg.connect(autocommit=False) as c:
        began = c.execute("SELECT now()").fetchone()[0]
        wait_runs(pg, name, 2)
        next_at = c.execute(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text))",
                            (name, f"{name}:2")).fetchone()[0]
        c.commit()
    fired = [r["tick"] for r in runs_of(pg, name)]
    assert next_at > max(fired) and next_at > began + SECOND
    pg.wait_for("SELECT count(*) > 0 FROM app.ticks WHERE tag = %s", f"{name}:2", timeout=10)
    assert pg.one("SELECT flow.pause_schedule(%s)", name) is True
    wait_finished(pg, [name])
    runs = runs_of(pg, name)
    ticks = [r["tick"] for r in runs]
    # one run each tick (the ticks fired before the replace kept their first run), none left out
    assert len(set(ticks)) == len(ticks) and consecutive(ticks) and ticks[0] <= next_at
    assert pg.one("SELECT count(*) FROM app.ticks WHERE tag LIKE %s", f"{name}:%") == len(runs)
    old = [r for r in runs if r["result"]["tag"] == f"{name}:1"]
    new = [r for r in runs if r["result"]["tag"] == f"{name}:2"]
    assert old and new and old[-1]["tick"] < new[0]["tick"] and len(old) + len(new) == len(runs)
    assert counter(pg, "ticks_skipped") == skipped_before


# ---------------------------------------------------------------- 2. missed ticks (a restart)

def test_ticks_missed_during_a_restart_are_skipped_but_the_last_catch_up_ones(pg):
    none, two = unique("down0"), unique("down2")
    for name, catch_up in ((none, 0), (two, 2)):
        pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text),"
               " catch_up => %s)", name, name, catch_up)
    wait_runs(pg, none, 2)
    wait_runs(pg, two, 2)
    pg.pg_ctl("-m", "fast", "-w", "-t", "60", "stop")
    time.sleep(3)   # the server stays down for 3 s: the ticks of that time are missed
    pg.pg_ctl("-w", "-t", "60", "start")
    pg.wait_ready()
    started = pg.one("SELECT pg_postmaster_start_time()")
    # the maintenance worker's start: ticks before it were missed (its own start
    # time, which flow._fire_schedules is given, is a moment after this)
    worker = pg.wait_for("SELECT backend_start FROM pg_stat_activity WHERE backend_type = 'flow maintenance'")
    poll(lambda: all(sum(r["created_at"] >= started for r in runs_of(pg, n)) >= 3 for n in (none, two)),
         30, 0.05, "3 runs of each schedule after the restart")
    for name in (none, two):
        assert pg.one("SELECT flow.pause_schedule(%s)", name) is True

    def split(name):
        runs = runs_of(pg, name)
        before = [r["tick"] for r in runs if r["created_at"] < started]
        after = [r["tick"] for r in runs if r["created_at"] >= started]
        assert before and after and consecutive(before) and consecutive(after), (before, after)
        return before[-1], after, [r for r in runs if r["created_at"] >= started]

    last0, after0, _ = split(none)
    last2, after2, late2 = split(two)
    # catch_up => 0: no run of a tick between the last before the stop and the
    # first at or after the worker's start
    gap0 = int((after0[0] - last0) / SECOND) - 1
    assert after0[0] >= worker and after0[0] < worker + 2 * SECOND, (after0[0], worker)
    # (3 s down: at least 2 ticks missed; the one enqueued ahead before the stop ran after it)
    assert gap0 >= 2, (last0, after0[0])
    # catch_up => 2: the last 2 missed ticks ran (late, after the restart), then
    # the same ticks as the other schedule; none before them since the stop
    assert after2[0] < worker <= after2[0] + 2 * SECOND, (after2, worker)
    assert after2[2] == after0[0] and after2[:2] == [after0[0] - 2 * SECOND, after0[0] - SECOND]
    # (fired when the worker started: the first over a second late, the second late too)
    assert late2[0]["created_at"] - late2[0]["tick"] > SECOND and late2[1]["created_at"] > late2[1]["tick"]
    gap2 = int((after2[0] - last2) / SECOND) - 1
    # (the 2 it caught up are 2 fewer skipped)
    assert gap2 == max(gap0 - 2, 0), (gap0, gap2, last2, after2)
    print(f"\nrestart: missed ticks skipped: {gap0} (catch_up 0), {gap2} (catch_up 2, and 2 run late by"
          f" {(late2[0]['created_at'] - late2[0]['tick']).total_seconds():.3f} and"
          f" {(late2[1]['created_at'] - late2[1]['tick']).total_seconds():.3f} s)")
    # the runs of both, after the restart, succeeded
    wait_finished(pg, [none, two])
    assert pg.one("SELECT count(*) FROM flow.runs WHERE split_part(key, ':', 2) = ANY (%s) AND status <> 'succeeded'",
                  [none, two]) == 0
    # the counters (shared memory: since the restart) say the same: every skipped
    # tick was one of the downtime's, every fired one has its run
    pg.wait_for("SELECT value = %s FROM flow.stats WHERE name = 'ticks_skipped'", gap0 + gap2, timeout=5)
    pg.wait_for("SELECT value = %s FROM flow.stats WHERE name = 'ticks_fired'", len(after0) + len(after2),
                timeout=5)


# ---------------------------------------------------------------- 3. time zones and DST

# (instants in UTC; New York: EST -05 / EDT -04, spring forward 2026-03-08
# 02:00 -> 03:00, fall back 2026-11-01 02:00 -> 01:00)
def ticks_after(pg, cron, zone, after, count):
    out = []
    for _ in range(count):
        after = pg.one("SELECT flow._cron_next(%s, %s, %s::timestamptz)", cron, zone, after)
        out.append(after)
    return [t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S") for t in out]


@pytest.mark.parametrize("cron, zone, after, expected", [
    # a time the spring-forward skips (02:30) runs at the first instant after the gap (03:00 EDT)
    ("30 2 * * *", "America/New_York", "2026-03-07 00:00 America/New_York",
     ["2026-03-07 07:30:00", "2026-03-08 07:00:00", "2026-03-09 06:30:00"]),
    # a time the fall-back repeats (01:30) runs once that day, at its first occurrence (EDT)
    ("30 1 * * *", "America/New_York", "2026-10-31 00:00 America/New_York",
     ["2026-10-31 05:30:00", "2026-11-01 05:30:00", "2026-11-02 06:30:00"]),
    # after the first 01:30 of the fall-back day, the next is the next day's (not the repeated 01:30 EST)
    ("30 1 * * *", "America/New_York", "2026-11-01 05:30:00+00", ["2026-11-02 06:30:00"]),
    # Paris: spring forward 2026-03-29 02:00 -> 03:00, fall back 2026-10-25 03:00 -> 02:00
    ("0 2 * * *", "Europe/Paris", "2026-03-28 12:00+00", ["2026-03-29 01:00:00", "2026-03-30 00:00:00"]),
    ("30 2 * * *", "Europe/Paris", "2026-10-24 12:00+00", ["2026-10-25 00:30:00", "2026-10-26 01:30:00"]),
    # the southern hemisphere: Sydney springs forward 2026-10-04 02:00 -> 03:00 (+10 -> +11)
    ("30 2 * * *", "Australia/Sydney", "2026-10-02 12:00+00", ["2026-10-02 16:30:00", "2026-10-03 16:00:00",
                                                                "2026-10-04 15:30:00"]),
    # no DST: Kolkata is +05:30 all year
    ("0 9 * * *", "Asia/Kolkata", "2026-06-01 00:00+00", ["2026-06-01 03:30:00", "2026-06-02 03:30:00"]),
    # nicknames and seconds
    ("@hourly", "UTC", "2026-03-29 00:00+00", ["2026-03-29 01:00:00"]),
    ("@daily", "America/New_York", "2026-03-07 12:00+00", ["2026-03-08 05:00:00", "2026-03-09 04:00:00"]),
    ("@weekly", "UTC", "2026-03-29 00:00+00", ["2026-04-05 00:00:00"]),
    ("@monthly", "UTC", "2026-03-29 00:00+00", ["2026-04-01 00:00:00"]),
    ("@yearly", "UTC", "2026-03-29 00:00+00", ["2027-01-01 00:00:00"]),
    ("*/20 * * * * *", "UTC", "2026-03-29 00:00:05+00", ["2026-03-29 00:00:20", "2026-03-29 00:00:40"]),
])
def test_cron_next_in_a_time_zone_across_dst(pg, cron, zone, after, expected):
    assert ticks_after(pg, cron, zone, after, len(expected)) == expected


def test_a_schedule_in_a_time_zone_returns_its_next_tick_in_utc(pg):
    name = unique("kolkata")
    next_at, now = pg.all("SELECT flow.schedule(%s, '0 9 * * *', 'tick', timezone => 'Asia/Kolkata'), now()",
                          name)[0]
    now = now.astimezone(timezone.utc)
    expected = now.replace(hour=3, minute=30, second=0, microsecond=0)
    if expected <= now:
        expected += timedelta(days=1)
    assert next_at == expected
    assert schedule_row(pg, name)[1] == "Asia/Kolkata" and schedule_row(pg, name)[6] == expected
    # the same cron in UTC: 09:00 UTC
    utc = pg.one("SELECT flow.schedule(%s, '0 9 * * *', 'tick')", unique("utc"))
    assert (utc.astimezone(timezone.utc).hour, utc.minute) == (9, 0)


def due(pg, cron, zone, next_tick, started, now, grace_s, catch_up, until=None, max_fire=1000):
    """flow._schedule_due's answer, ticks fired up to `until` (default: `now`)."""
    fire, skipped, next_at = pg.all("SELECT fire, skipped, next_tick FROM flow._schedule_due(%s, %s, %s::timestamptz,"
                                    " %s::timestamptz, %s::timestamptz, %s::timestamptz, %s, %s, %s)",
                                    cron, zone, next_tick, started, now, until or now, grace_s, catch_up, max_fire)[0]
    fmt = "%H:%M:%S" if len(cron.split()) == 6 else "%m-%d %H:%M"   # (seconds, or whole minutes and days)
    return ([t.astimezone(timezone.utc).strftime(fmt) for t in fire], skipped,
            next_at and next_at.astimezone(timezone.utc).strftime(fmt))


def test_which_due_ticks_fire_and_which_were_missed(pg):
    day = "2026-05-01 "
    # ticks from 12:00:00 to 12:00:15, the worker started at 12:00:10: the 10
    # before it were missed; catch_up 0 skips them all, 2 fires the last 2
    assert due(pg, EVERY_SECOND, "UTC", day + "12:00:00+00", day + "12:00:10+00", day + "12:00:15+00", 60, 0) == (
        [f"12:00:{s}" for s in range(10, 16)], 10, "12:00:16")
    assert due(pg, EVERY_SECOND, "UTC", day + "12:00:00+00", day + "12:00:10+00", day + "12:00:15+00", 60, 2) == (
        ["12:00:08", "12:00:09"] + [f"12:00:{s}" for s in range(10, 16)], 8, "12:00:16")
    # more catch_up than missed ticks: all of them
    assert due(pg, EVERY_SECOND, "UTC", day + "12:00:00+00", day + "12:00:10+00", day + "12:00:15+00", 60, 1000) == (
        [f"12:00:{s:02}" for s in range(0, 16)], 0, "12:00:16")
    # a tick at the worker's start, and one at now, fire
    assert due(pg, EVERY_SECOND, "UTC", day + "12:00:09+00", day + "12:00:10+00", day + "12:00:11+00", 60, 0) == (
        ["12:00:10", "12:00:11"], 1, "12:00:12")
    # the worker long running: ticks more than grace_s (60 s) ago were missed
    assert due(pg, "* * * * *", "UTC", day + "12:00:00+00", day + "11:00:00+00", day + "12:05:00+00", 60, 0) == (
        ["05-01 12:04", "05-01 12:05"], 4, "05-01 12:06")
    assert due(pg, "* * * * *", "UTC", day + "12:00:00+00", day + "11:00:00+00", day + "12:05:00+00", 60, 1) == (
        ["05-01 12:03", "05-01 12:04", "05-01 12:05"], 3, "05-01 12:06")
    # nothing due yet: nothing fires, next_tick stays
    assert due(pg, "* * * * *", "UTC", day + "12:00:00+00", day + "11:00:00+00", day + "11:59:59+00", 60, 1) == (
        [], 0, "05-01 12:00")
    # in a zone: 09:00 Kolkata daily, 4 days missed (a dump restored), catch_up 1
    assert due(pg, "0 9 * * *", "Asia/Kolkata", "2026-05-01 03:30+00", "2026-04-01 00:00+00", "2026-05-04 04:00+00",
               60, 1) == (["05-04 03:30"], 3, "05-05 03:30")
    # across the fall-back: the repeated 01:30 fires once
    assert due(pg, "30 1 * * *", "America/New_York", "2026-10-31 05:30+00", "2026-10-01 00:00+00",
               "2026-11-02 07:00+00", 86400 * 7, 0) == (["10-31 05:30", "11-01 05:30", "11-02 06:30"], 0, "11-03 06:30")
    # at most 1000 ticks fire in one call; the rest from the next tick on
    fire, skipped, next_at = pg.all(f"SELECT cardinality(fire), skipped, next_tick FROM flow._schedule_due("
                                    f"'{EVERY_SECOND}', 'UTC', '{day}12:00:00+00', '{day}12:00:00+00',"
                                    f" '{day}13:00:00+00', '{day}13:00:00+00', 3600, 0, 1000)")[0]
    assert (fire, skipped, next_at.astimezone(timezone.utc).strftime("%H:%M:%S")) == (1000, 0, "12:16:40")
    # ticks ahead of now, up to `until`, fire too (enqueued ahead of their time), and none of them was missed
    assert due(pg, EVERY_SECOND, "UTC", day + "12:00:09+00", day + "12:00:10+00", day + "12:00:11+00", 60, 0,
               until=day + "12:00:12.5+00") == (["12:00:10", "12:00:11", "12:00:12"], 1, "12:00:13")
    # the budget stops at a tick to fire, never among the missed: the last catch_up of them fire
    assert due(pg, EVERY_SECOND, "UTC", day + "12:00:00+00", day + "12:00:10+00", day + "12:00:15+00", 60, 2,
               max_fire=3) == (["12:00:08", "12:00:09", "12:00:10"], 8, "12:00:11")
    # an expression that is not valid: nothing (the schedule could not have been made)
    assert due(pg, "bad", "UTC", day + "12:00:00+00", day + "12:00:10+00", day + "12:00:15+00", 60, 0) == (
        [], 0, None)


# ---------------------------------------------------------------- 4. overlap

def test_overlap_false_skips_ticks_while_the_last_run_is_unfinished(pg):
    single, many = unique("single"), unique("many")
    skipped_before = counter(pg, "ticks_skipped")
    firsts = {}
    for name, overlap in ((single, "false"), (many, "true")):
        firsts[name] = pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick',"
                              f" jsonb_build_object('tag', %s::text, 'sleep', 2.5), overlap => {overlap})", name, name)
    wait_runs(pg, single, 3, timeout=30)
    for name in (single, many):
        assert pg.one("SELECT flow.pause_schedule(%s)", name) is True
    wait_finished(pg, [single, many])
    assert pg.one("SELECT count(*) FROM flow.runs WHERE split_part(key, ':', 2) = ANY (%s) AND status <> 'succeeded'",
                  [single, many]) == 0

    # overlap => false: each handler began after the one before had ended
    spans = handler_spans(pg, single)
    assert len(spans) == count_runs(pg, single) >= 3
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    # ... and ticks were skipped: every tick from the first to the schedule's
    # next one fired or was skipped, and most were skipped
    ticks = [r["tick"] for r in runs_of(pg, single)]
    assert ticks[0] == firsts[single]
    assert all(b - a >= 3 * SECOND for a, b in zip(ticks, ticks[1:])), ticks    # (2.5 s each)
    next_tick = schedule_row(pg, single)[6]
    skipped = int((next_tick - firsts[single]) / SECOND) - len(ticks)
    assert skipped >= 2 * (len(ticks) - 1)
    # (the other schedule skips nothing)
    pg.wait_for("SELECT value - %s = %s FROM flow.stats WHERE name = 'ticks_skipped'", skipped_before, skipped,
                timeout=5)

    # overlap => true: every tick ran, and runs of it ran at the same time
    ticks = [r["tick"] for r in runs_of(pg, many)]
    assert ticks[0] == firsts[many] and consecutive(ticks)
    assert ticks[-1] + SECOND == schedule_row(pg, many)[6]
    spans = handler_spans(pg, many)
    assert len(spans) == len(ticks)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), spans


# ---------------------------------------------------------------- 5. bad input

def test_bad_input_is_refused_and_changes_nothing(pg):
    keep = unique("keep")
    pg.one("SELECT flow.schedule(%s, '0 0 1 1 *', 'tick', '{\"a\": 1}')", keep)
    pg.one("SELECT flow.pause_schedule(%s)", keep)
    table = "SELECT * FROM flow._schedules ORDER BY owner, name"
    before = pg.all(table)
    fresh = unique("fresh")

    def refused(sqlstate, sql, *args, user="postgres"):
        # a new schedule and a replacement of `keep`: both refused
        for name in (fresh, keep):
            assert pg.sqlstate(sql, name, *args, user=user) == sqlstate, (sql, name, args)

    base = "SELECT flow.schedule(%s, {cron}, {definition}, {args}, timezone => {zone}, overlap => {overlap}," \
           " catch_up => {catch_up})"

    def call(cron="'* * * * *'", definition="'tick'", args="'{}'", zone="'UTC'", overlap="true", catch_up="0"):
        return base.format(cron=cron, definition=definition, args=args, zone=zone, overlap=overlap,
                           catch_up=catch_up)

    for cron in ("61 * * * *", "* * *", "0 0 30 2 *", "* * * * * * *", "", "@fortnightly", "0 25 * * *",
                 "* * * 13 *", "not cron at all"):
        refused("FL022", call(cron="%s"), cron)
    refused("FL022", call(cron="NULL"))
    for zone in ("Mars/Base", "", "UTC+99"):
        refused("FL023", call(zone="%s"), zone)
    refused("22004", call(zone="NULL"))
    for name in (None, "", "   ", "x" * 991):
        assert pg.sqlstate(call(), name) == "FL002", name
    for catch_up in ("-1", "1001", "NULL"):
        refused("22023", call(catch_up=catch_up))
    refused("22004", call(overlap="NULL"))
    refused("FL001", call(definition="'no_such_definition'"))
    # a definition the caller may not start (postgres's, to bob): as unknown as a missing one
    refused("FL001", call(definition="'tick'"), user="bob")
    refused("FL001", call(definition="'alice_tick'"), user="bob")
    for args in ("'[]'", "'\"x\"'", "'1'", "'null'", "NULL"):
        refused("FL003", call(args=args))
    assert pg.sqlstate("SELECT flow.pause_schedule(%s, NULL)", keep) == "22004"

    assert pg.all(table) == before
    assert pg.one("SELECT count(*) FROM flow.schedules WHERE name = %s", fresh) == 0
    # the limits themselves are fine
    for catch_up in (0, 1000):
        assert pg.one(call(catch_up=str(catch_up)), fresh) is not None
        assert schedule_row(pg, fresh)[11] == catch_up
    assert pg.one(call(), "x" * 990) is not None


# ---------------------------------------------------------------- 6. roles

def test_a_schedule_is_its_owners_alone(pg):
    mine, same = unique("alices"), unique("both")
    # alice's schedule, of her definition, every second
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'alice_tick', jsonb_build_object('tag', %s::text))",
           mine, mine, user="alice")
    # bob cannot see it, read the table, pause or remove it
    assert pg.one("SELECT count(*) FROM flow.schedules", user="bob") == 0
    assert pg.sqlstate("SELECT * FROM flow._schedules", user="bob") == "42501"
    assert pg.one("SELECT flow.pause_schedule(%s)", mine, user="bob") is False
    assert pg.one("SELECT flow.unschedule(%s)", mine, user="bob") is False
    row = schedule_row(pg, mine, user="alice")
    assert row is not None and row[5] is False and row[9] == "alice"
    # its runs are alice's, enqueued as alice, and bob sees none of them
    runs = wait_runs(pg, mine, 2, user="alice")
    assert {r["owner"] for r in runs} == {"alice"}
    assert pg.one("SELECT count(*) FROM flow.runs WHERE left(key, length(%s)) = %s", f"schedule:{mine}:",
                  f"schedule:{mine}:", user="bob") == 0
    assert pg.one("SELECT count(*) FROM flow.runs WHERE id = %s", runs[0]["id"], user="bob") == 0
    # bob cannot schedule alice's definition, not opened to him
    assert pg.sqlstate(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'alice_tick')", unique("b"), user="bob") == "FL001"

    # one name, two schedules: alice's and bob's, each every second
    pg.one("SELECT flow.grant_definition('alice_tick', 'bob')", user="alice")
    for who in ("alice", "bob"):
        pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'alice_tick', jsonb_build_object('tag', %s::text))",
               same, f"{same}:{who}", user=who)
    assert pg.one("SELECT count(*) FROM flow.schedules WHERE name = %s", same) == 2     # (postgres sees both)
    assert pg.all("SELECT owner::text FROM flow.schedules", user="bob") == [("bob",)]
    assert pg.one("SELECT count(*) FROM flow.schedules WHERE name = %s", same, user="alice") == 1
    # each fires its own runs, as its owner, under the same keys: one run each per tick
    poll(lambda: pg.one("SELECT count(*) FROM (SELECT key FROM flow.runs WHERE left(key, length(%s)) = %s"
                        " GROUP BY key HAVING count(*) = 2) k", f"schedule:{same}:", f"schedule:{same}:") >= 2,
         30, 0.05, "two ticks that both schedules fired")
    for who in ("alice", "bob"):
        runs = runs_of(pg, same, user=who)
        assert runs and {r["owner"] for r in runs} == {who}
        assert pg.one("SELECT count(*) FROM app.ticks t JOIN flow.runs r ON r.id = t.run_id"
                      " WHERE r.owner::text <> %s AND t.tag = %s", who, f"{same}:{who}") == 0
    # bob pauses and then removes his: alice's goes on
    assert pg.one("SELECT flow.pause_schedule(%s)", same, user="bob") is True
    assert schedule_row(pg, same, user="alice")[5] is False
    assert pg.one("SELECT flow.unschedule(%s)", same, user="bob") is True
    assert schedule_row(pg, same, user="bob") is None
    row = schedule_row(pg, same, user="alice")
    assert row is not None and row[5] is False
    alice_count = count_runs(pg, same, user="alice")
    wait_runs(pg, same, alice_count + 1, user="alice")

    # the owner's right to start the definition is checked again at each tick:
    # alice revokes bob's, and bob's schedule's ticks are skipped (WARNING)
    theirs = unique("revoked")
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'alice_tick')", theirs, user="bob")
    wait_runs(pg, theirs, 1, user="bob")
    skipped = counter(pg, "ticks_skipped")
    pg.one("SELECT flow.revoke_definition('alice_tick', 'bob')", user="alice")
    revoked_at = pg.one("SELECT clock_timestamp()")
    pg.wait_for("SELECT value >= %s FROM flow.stats WHERE name = 'ticks_skipped'", skipped + 2, timeout=10)
    assert pg.one("SELECT flow.pause_schedule(%s)", theirs, user="bob") is True
    runs = runs_of(pg, theirs, user="bob")
    last = schedule_row(pg, theirs, user="bob")[7]
    # no run begun after the revoke: the last tick fired is the last run's, and ticks went by since
    assert all(r["created_at"] < revoked_at for r in runs), (runs, revoked_at)
    assert runs[-1]["tick"] == last and schedule_row(pg, theirs, user="bob")[6] > last + 2 * SECOND
    assert f"flow: schedule {theirs} of role" in pg.log() and "skipped its tick" in pg.log()


# ---------------------------------------------------------------- 7. pause, resume, replace, unschedule

def test_pause_resume_replace_and_unschedule(pg):
    name = unique("pause")
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text))", name, name)
    wait_runs(pg, name, 1)
    assert pg.one("SELECT flow.pause_schedule(%s)", name) is True
    paused_at = pg.one("SELECT clock_timestamp()")
    assert schedule_row(pg, name)[5] is True
    count = count_runs(pg, name)
    time.sleep(2)   # paused: no run within 2 s (the passage of time is what is checked)
    assert count_runs(pg, name) == count
    # pausing again is fine; resuming fires from the next tick after now
    assert pg.one("SELECT flow.pause_schedule(%s, true)", name) is True
    resumed, resumed_at = pg.all("SELECT flow.pause_schedule(%s, false), now()", name)[0]
    assert resumed is True
    row = schedule_row(pg, name)
    assert row[5] is False and resumed_at < row[6] <= resumed_at + 3 * SECOND   # (it may have fired one ahead)
    wait_runs(pg, name, count + 2)
    # the ticks while paused were not caught up
    ticks = [r["tick"] for r in runs_of(pg, name)]
    # (but the one enqueued ahead of its time before the pause, at most a second)
    assert not [t for t in ticks if paused_at + SECOND < t <= resumed_at], (ticks, paused_at, resumed_at)
    assert resumed_at < [t for t in ticks if t > resumed_at][0] <= row[6]

    # replacing: the new cron, args and next tick, and a paused schedule stays paused
    yearly = pg.one("SELECT flow.schedule(%s, '0 0 1 1 *', 'tick', '{\"b\": 2}')", name)
    assert yearly.astimezone(timezone.utc).strftime("%m-%d %H:%M:%S") == "01-01 00:00:00"
    row = schedule_row(pg, name)
    assert (row[0], row[3], row[5], row[6]) == ("0 0 1 1 *", {"b": 2}, False, yearly)
    assert pg.one("SELECT flow.pause_schedule(%s)", name) is True
    daily = pg.one("SELECT flow.schedule(%s, '0 12 * * *', 'tick', '{\"b\": 3}')", name)
    row = schedule_row(pg, name)
    assert (row[0], row[5], row[6]) == ("0 12 * * *", True, daily) and daily != yearly
    assert daily.astimezone(timezone.utc).strftime("%H:%M:%S") == "12:00:00"

    # unscheduling stops it; a second time, or a name never used, says false
    assert pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text))",
                  name, name)
    assert pg.one("SELECT flow.pause_schedule(%s, false)", name) is True
    wait_runs(pg, name, count_runs(pg, name) + 1)
    assert pg.one("SELECT flow.unschedule(%s)", name) is True
    count = count_runs(pg, name)   # (a tick fired before the unschedule committed counts)
    time.sleep(2)   # unscheduled: no run within 2 s (the passage of time is what is checked)
    assert count_runs(pg, name) == count
    assert schedule_row(pg, name) is None
    assert pg.one("SELECT flow.unschedule(%s)", name) is False
    assert pg.one("SELECT flow.pause_schedule(%s)", name) is False
    assert pg.one("SELECT flow.unschedule(%s)", unique("never")) is False


# ---------------------------------------------------------------- 8. counters

def prometheus(pg, family):
    lines = [line for (line,) in pg.all("SELECT line FROM flow.prometheus WHERE line LIKE %s", f"%{family}%")]
    assert f"# TYPE {family} counter" in lines, lines
    values = [line for line in lines if line.startswith(family + " ")]
    assert len(values) == 1, lines
    return int(values[0].split()[1])


def test_tick_counters_and_their_prometheus_lines(pg):
    fired, skipped = counter(pg, "ticks_fired"), counter(pg, "ticks_skipped")
    assert prometheus(pg, "flow_ticks_fired_total") >= fired
    assert prometheus(pg, "flow_ticks_skipped_total") >= skipped
    name = unique("counted")
    # 1.2 s runs every second, one at a time: some ticks fire, some are skipped
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text, 'sleep', 1.2),"
           " overlap => false)", name, name)
    pg.wait_for("SELECT value >= %s FROM flow.stats WHERE name = 'ticks_fired'", fired + 2)
    pg.wait_for("SELECT value >= %s FROM flow.stats WHERE name = 'ticks_skipped'", skipped + 1)
    assert pg.one("SELECT flow.pause_schedule(%s)", name) is True
    count = count_runs(pg, name)
    pg.wait_for("SELECT value = %s FROM flow.stats WHERE name = 'ticks_fired'", fired + count, timeout=5)
    assert prometheus(pg, "flow_ticks_fired_total") == counter(pg, "ticks_fired") == fired + count
    assert prometheus(pg, "flow_ticks_skipped_total") == counter(pg, "ticks_skipped") > skipped
    wait_finished(pg, [name])


# ---------------------------------------------------------------- 9. a hostile owner

def test_a_roles_open_transaction_or_slow_check_never_holds_up_other_schedules(pg):
    """The maintenance worker serves every role: what one schedule's owner
    holds (the run key of its next tick, in an open transaction) or slows (its
    args_type check) costs that schedule a tick at most, never the others'."""
    pg.all("""
        CREATE TABLE IF NOT EXISTS app.slow_checks (on_ boolean);
        GRANT ALL ON app.slow_checks TO PUBLIC;
        CREATE OR REPLACE FUNCTION app.check_slowly(args jsonb) RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM app.slow_checks WHERE on_) THEN PERFORM pg_sleep(30); END IF;
            RETURN true;
        END $$;
        DROP DOMAIN IF EXISTS app.slow_args;
        CREATE DOMAIN app.slow_args AS jsonb CHECK (app.check_slowly(VALUE));
        GRANT USAGE ON DOMAIN app.slow_args TO PUBLIC""")
    pg.one("SELECT flow.define('alice_slow', 'app.tick'::regproc, args_type => 'app.slow_args')", user="alice")
    victim, held, slow = unique("victim"), unique("held"), unique("slow")
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'tick', jsonb_build_object('tag', %s::text))", victim, victim)
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'alice_tick', jsonb_build_object('tag', %s::text))",
           held, held, user="alice")
    pg.one(f"SELECT flow.schedule(%s, '{EVERY_SECOND}', 'alice_slow', '{{}}')", slow, user="alice")
    wait_runs(pg, victim, 1)
    pg.all("INSERT INTO app.slow_checks VALUES (true)")
    try:
        with pg.connect(user="alice", autocommit=False) as c:
            # alice holds the run keys of her schedule's next ticks in an open transaction
            now = pg.one("SELECT clock_timestamp()")
            for k in range(2, 6):
                tick = (now + k * SECOND).replace(microsecond=0)
                c.execute("SELECT flow.enqueue('alice_tick', jsonb_build_object('tag', %s::text), key => %s)",
                          (held, f"schedule:{held}:{tick:%Y-%m-%dT%H:%M:%SZ}"))
            before = count_runs(pg, victim)
            time.sleep(4)   # (time itself: the other schedule fires each second meanwhile)
            fired = count_runs(pg, victim) - before
            c.rollback()
        assert fired >= 3, fired
        # the maintenance worker kept its pace: its schedule fired every second throughout
        ticks = [r["tick"] for r in runs_of(pg, victim)]
        assert consecutive(ticks), ticks
    finally:
        pg.all("DELETE FROM app.slow_checks")
        pg.all("SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE backend_type = 'flow worker'"
               " AND wait_event = 'PgSleep'")


def test_a_role_owns_at_most_max_schedules_per_role(pg):
    pg.all("ALTER SYSTEM SET flow.max_schedules_per_role = 2")
    pg.all("SELECT pg_reload_conf()")
    try:
        pg.wait_for("SELECT current_setting('flow.max_schedules_per_role') = '2'", user="alice")
        names = [unique("cap") for _ in range(3)]
        for name in names[:2]:
            pg.one("SELECT flow.schedule(%s, '0 0 1 1 *', 'alice_tick')", name, user="alice")
        assert pg.sqlstate("SELECT flow.schedule(%s, '0 0 1 1 *', 'alice_tick')", names[2], user="alice") == "FL018"
        # replacing one of hers is fine; a superuser has no limit
        pg.one("SELECT flow.schedule(%s, '0 0 2 1 *', 'alice_tick')", names[0], user="alice")
        for name in names:
            pg.one("SELECT flow.schedule(%s, '0 0 1 1 *', 'tick')", name)
        assert pg.one("SELECT count(*) FROM flow._schedules WHERE owner = 'alice'::regrole") == 2
    finally:
        pg.all("ALTER SYSTEM RESET flow.max_schedules_per_role")
        pg.all("SELECT pg_reload_conf()")
