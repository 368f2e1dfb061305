-- Schedules: runs started by the clock. A schedule belongs to the role that
-- made it, names a cron expression in a time zone (src/schedules.rs) and a
-- definition with its args; the maintenance worker fires each tick as an
-- enqueue by the schedule's owner (src/maintenance.rs, flow._fire_schedules).

-- Create or replace the caller's schedule `name`; returns its next tick.
-- Everything an enqueue would check is checked now (the definition, the
-- queue, the args), and again at each tick, as the owner then is.
CREATE FUNCTION flow._schedule(caller oid, name text, cron text, definition text, args jsonb, timezone text,
    queue text, overlap boolean, catch_up integer)
RETURNS timestamptz
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
-- (the ON CONFLICT below names columns owner and name, which cannot be qualified)
DECLARE
    problem text := flow._schedule_problem(cron, timezone);
    plan record;
    next_at timestamptz;
BEGIN
    PERFORM flow._require_name('name', name);
    -- (its runs' keys, schedule:<name>:<tick>, are at most 1 KiB too)
    IF octet_length(name) > 990 THEN
        RAISE EXCEPTION 'flow: a schedule name is at most 990 bytes, got %', octet_length(name) USING ERRCODE = 'FL002';
    END IF;
    IF timezone IS NULL OR overlap IS NULL THEN
        RAISE EXCEPTION 'flow: % must not be NULL', CASE WHEN timezone IS NULL THEN 'timezone' ELSE 'overlap' END
            USING ERRCODE = '22004';
    END IF;
    PERFORM flow._require_name('definition', definition);
    IF problem LIKE 'cron:%' THEN
        RAISE EXCEPTION 'flow: invalid cron expression %: %', coalesce(quote_literal(cron), 'NULL'), substr(problem, 7)
            USING ERRCODE = 'FL022',
                  HINT = 'Give 5 fields (minute hour day-of-month month day-of-week), 6 with a leading seconds field, or @yearly, @monthly, @weekly, @daily, @hourly.';
    ELSIF problem IS NOT NULL THEN
        RAISE EXCEPTION 'flow: %', substr(problem, 11) USING ERRCODE = 'FL023';
    END IF;
    IF catch_up IS NULL OR catch_up < 0 OR catch_up > 1000 THEN
        RAISE EXCEPTION 'flow: catch_up must be from 0 to 1000, got %', coalesce(catch_up::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    -- (a role's schedules are bounded: each costs the maintenance worker, which serves every role)
    IF NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller)
       AND NOT EXISTS (SELECT 1 FROM flow._schedules x WHERE x.owner = caller AND x.name = _schedule.name)
       AND (SELECT count(*) FROM flow._schedules x WHERE x.owner = caller)
           >= current_setting('flow.max_schedules_per_role')::integer THEN
        RAISE EXCEPTION 'flow: role % has flow.max_schedules_per_role (%) schedules already',
            caller::regrole, current_setting('flow.max_schedules_per_role') USING ERRCODE = 'FL018';
    END IF;
    plan := flow._plan_enqueue(caller, definition, NULL, queue, NULL, NULL, NULL);
    PERFORM flow._require_payload('args', args);
    PERFORM flow._require_args_fit(definition, plan.def_owner, plan.def_args_type, args);
    -- (after the clock, not the transaction's start, and after the last tick
    -- enqueued, up to a second ahead: no tick is fired twice, and the one
    -- enqueued already runs as it was enqueued)
    next_at := flow._cron_next(cron, timezone, greatest(clock_timestamp(),
        (SELECT x.last_tick FROM flow._schedules x WHERE x.owner = caller AND x.name = _schedule.name)));
    INSERT INTO flow._schedules AS s (owner, name, cron, timezone, definition, args, queue, overlap, catch_up, next_tick)
    VALUES (caller, name, cron, timezone, definition, args, queue, overlap, catch_up, next_at)
    ON CONFLICT (owner, name) DO UPDATE SET
        cron = excluded.cron, timezone = excluded.timezone, definition = excluded.definition, args = excluded.args,
        queue = excluded.queue, overlap = excluded.overlap, catch_up = excluded.catch_up,
        next_tick = excluded.next_tick, updated_at = now();   -- (a paused schedule stays paused)
    PERFORM flow._mark_owner(caller);
    PERFORM flow._wake_maintenance();
    RETURN next_at;
END $$;

-- Delete the caller's schedule `name`; false if it has none of that name.
-- (Runs it started go on.)
CREATE FUNCTION flow._unschedule(caller oid, name text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM flow._schedules s WHERE s.owner = caller AND s.name = _unschedule.name;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT flow._owns_anything(caller) THEN
        PERFORM flow._unmark_owner(caller);
    END IF;
    RETURN true;
END $$;

-- Pause (or resume) the caller's schedule `name`; false if it has none of
-- that name. A paused schedule fires nothing more (a tick enqueued ahead of
-- its time already, at most a second, still runs); resumed, it fires from
-- its next tick after now (the ticks it was paused for are not caught up).
CREATE FUNCTION flow._pause_schedule(caller oid, name text, paused boolean) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF paused IS NULL THEN
        RAISE EXCEPTION 'flow: paused must not be NULL' USING ERRCODE = '22004';
    END IF;
    UPDATE flow._schedules s SET
        next_tick = CASE WHEN s.paused AND NOT _pause_schedule.paused
                         THEN flow._cron_next(s.cron, s.timezone, greatest(clock_timestamp(), s.last_tick))
                         ELSE s.next_tick END,
        paused = _pause_schedule.paused, updated_at = now()
    WHERE s.owner = caller AND s.name = _pause_schedule.name;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM flow._wake_maintenance();
    RETURN true;
END $$;

-- Fire the due ticks of up to max_count schedules (the maintenance worker,
-- src/maintenance.rs, one short transaction at a time; a schedule another
-- transaction holds waits for the next round). Each tick is enqueued as the
-- schedule's owner, up to `lead` before its time and due at it (run_at), so
-- the time firing takes is not the tick's lateness: its run starts when a
-- worker's sleep until the next due command ends. (A schedule with overlap
-- => false fires at the tick, when it can tell whether the last run is
-- over.) A run is keyed schedule:<name>:<tick in UTC>: that key is the
-- owner's, so a tick fired again (a restore, a failover, a round whose
-- commit was lost) finds its run instead of starting another. A tick whose
-- enqueue fails (the definition's owner revoked the schedule owner's right
-- to start it, args that no longer fit) is skipped with a WARNING.
-- The firing never waits long and runs no user code, whatever a role does:
-- it waits at most lock_timeout for a lock (a run key or a queue held by the
-- owner's open transaction), and does not check args against the
-- definition's args_type (their check was made when the schedule was, and
-- the worker checks them again before each attempt): one role's schedule
-- cannot hold up the maintenance worker, which serves every role.
-- `started`: when the maintenance worker started; ticks that passed before
-- are missed (see src/schedules.rs, _schedule_due). At most max_ticks ticks
-- per call, each a subtransaction (more than 64 in one transaction slow
-- every backend's snapshots); returns true when it stopped there, more may be due.
CREATE FUNCTION flow._fire_schedules(started timestamptz, max_ticks integer, lead interval) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '100ms' AS $$
DECLARE
    -- how late a tick may be fired: later than this, it was missed (a dump
    -- restored long after it was made; the worker's own lag never nears it)
    grace_s constant bigint := 60;
    now_at timestamptz := clock_timestamp();
    s flow._schedules;
    fire timestamptz[];
    next_at timestamptz;
    tick timestamptz;
    skipped bigint;
    run uuid;
    budget integer := max_ticks;
    fired integer := 0;
    skipped_all bigint := 0;
BEGIN
    FOR s IN SELECT * FROM flow._schedules x                            -- index _schedules_due
             WHERE NOT x.paused AND x.next_tick <= now_at + lead AND (x.overlap OR x.next_tick <= now_at)
             ORDER BY x.next_tick LIMIT max_ticks FOR UPDATE SKIP LOCKED LOOP
        EXIT WHEN budget <= 0;
        SELECT d.fire, d.skipped, d.next_tick INTO fire, skipped, next_at
        FROM flow._schedule_due(s.cron, s.timezone, s.next_tick, started, now_at,
                                now_at + CASE WHEN s.overlap THEN lead ELSE interval '0' END, grace_s, s.catch_up,
                                budget) d;
        IF NOT s.overlap AND cardinality(fire) > 0 THEN
            -- one run at a time: the latest due tick, and none while the last one's run is unfinished
            skipped := skipped + cardinality(fire) - 1;
            fire := fire[cardinality(fire):];
            IF EXISTS (SELECT 1 FROM flow._run_rows r WHERE r.id = s.last_run_id AND r.status = 'running') THEN
                skipped := skipped + 1;
                fire := '{}';
            END IF;
        END IF;
        FOREACH tick IN ARRAY fire LOOP
            budget := budget - 1;
            BEGIN
                run := flow._enqueue(s.owner, s.definition, s.args,
                    'schedule:' || s.name || ':' || to_char(tick AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                    NULL, s.queue, NULL, tick, NULL, NULL, NULL, check_args => false);
                fired := fired + 1;
                s.last_tick := tick;
                s.last_run_id := run;
            EXCEPTION WHEN OTHERS THEN
                skipped := skipped + 1;
                RAISE WARNING 'flow: schedule % of role % skipped its tick at %: %', s.name, s.owner, tick, SQLERRM;
            END;
        END LOOP;
        IF next_at IS NULL THEN
            RAISE WARNING 'flow: schedule % of role % has no tick after %: it fires no more', s.name, s.owner,
                coalesce(s.last_tick, now_at);
        END IF;
        skipped_all := skipped_all + skipped;
        UPDATE flow._schedules x SET next_tick = next_at, last_tick = s.last_tick, last_run_id = s.last_run_id
        WHERE x.owner = s.owner AND x.name = s.name;
    END LOOP;
    PERFORM flow._observe('ticks_fired', fired);
    PERFORM flow._observe('ticks_skipped', skipped_all);
    RETURN budget <= 0;
END $$;

-- Milliseconds until the next tick of any schedule is to be fired (`lead`
-- before it, see _fire_schedules; NULL: none), for the maintenance worker's sleep.
CREATE FUNCTION flow._next_tick_ms(lead interval) RETURNS bigint
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT ceil(extract(epoch FROM least(
                       (SELECT min(x.next_tick) - lead FROM flow._schedules x           -- index _schedules_due
                        WHERE NOT x.paused AND x.overlap),
                       (SELECT min(x.next_tick) FROM flow._schedules x                  -- index _schedules_due
                        WHERE NOT x.paused AND NOT x.overlap))
                   - clock_timestamp()) * 1000)::bigint);
END $$;

