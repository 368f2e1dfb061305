-- Retention: pruning finished runs and retiring old journal entries.

-- Let the current transaction commit without waiting for its WAL to be
-- flushed (synchronous_commit off until it ends), for work that is done
-- again if a crash loses it. A later flushed commit flushes it too.
CREATE FUNCTION flow._commit_without_flush() RETURNS void
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    SELECT set_config('synchronous_commit', 'off', true)
$$;

-- Compress the full-page images the current transaction writes to WAL (lz4,
-- when the server compresses none and was built with it). Pruning deletes
-- rows from pages last written a retention ago, so nearly every page it
-- touches was checkpointed since and is logged whole: in a churn at 58,000
-- runs/s with a retention of a minute, its deletions wrote two thirds of all
-- full-page image bytes, a sixth of the WAL, and each checkpoint (every 7-8 s
-- there, max_wal_size = 1GB) brought the next round of them.
CREATE FUNCTION flow._compress_page_images() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('wal_compression') = 'off' THEN
        PERFORM set_config('wal_compression', 'lz4', true);
    END IF;
EXCEPTION WHEN invalid_parameter_value THEN
    NULL;   -- (a server built without lz4 keeps its setting)
END $$;

-- Delete the runs that finished more than `older_than` ago among the next
-- `max_runs` runs after `after` (in id order; NULL: from the oldest), with
-- their commands, attempts and waits. Returns how many were deleted and the
-- last run looked at (NULL: none left before the cut, start again from the
-- oldest next time). Run ids are UUIDv7, so "created before the cut" is a
-- range of the primary key: no index on finished_at is needed (one would
-- make every run's final update non-HOT), and the moving window never walks
-- the same unfinished runs twice in a round, however large a backlog is.
CREATE FUNCTION flow._prune(older_than interval, max_runs integer, after uuid,
    OUT pruned integer, OUT last uuid)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cut timestamptz := now() - older_than;
    hex text := lpad(to_hex((extract(epoch FROM cut) * 1000)::bigint), 12, '0');
    bound uuid := (substr(hex, 1, 8) || '-' || substr(hex, 9, 4) || '-7000-8000-000000000000')::uuid;
    start uuid := coalesce(after, '00000000-0000-0000-0000-000000000000');
    seen uuid[];
    with_row uuid[];
    alone_at tid[];
    ended_ids uuid[];
BEGIN
    -- (committed without waiting for its WAL to reach disk: a deletion lost
    -- to a crash is simply done again, and the maintenance worker, which prunes between
    -- its batches, waited for that flush after each of them: under a churn
    -- of 84,000 runs/s the drain fell behind once runs expired)
    PERFORM flow._commit_without_flush();
    PERFORM flow._compress_page_images();
    -- The window: the next max_runs runs, those with a row of their own and
    -- the runs' roots (see flow._runs), each part read in id order from its
    -- primary key and cut at max_runs, merged by id (as one union ordered by
    -- id, the planner sorted every run after `after`). A run with a row has
    -- its root in both parts: grouped as one run that has a row (rather than
    -- a probe of _runs for every root: a third of the window's time under
    -- EXPLAIN ANALYZE, 5,000 runs). A run
    -- without a row is its root alone, and ended when the root did: that is
    -- read here, with where the root's row is, and such a run is that row to
    -- delete (the common run; no lookup of its run or of its commands). A
    -- run with a row is read through flow._run_rows below.
    SELECT array_agg(x.id ORDER BY x.id),   -- (in the order read: nothing to sort)
           array_agg(x.id) FILTER (WHERE x.has_row),
           array_agg(x.row_at) FILTER (WHERE NOT x.has_row AND x.finished_at < cut)
    INTO seen, with_row, alone_at
    FROM (
        SELECT w.id, bool_or(w.has_row) AS has_row, max(w.finished_at) AS finished_at, max(w.row_at) AS row_at
        FROM (
            (SELECT r.id, true AS has_row, NULL::timestamptz AS finished_at, NULL::tid AS row_at FROM flow._runs r
             WHERE r.id > start AND r.id < bound ORDER BY r.id LIMIT max_runs)
            UNION ALL
            (SELECT c.id, false, c.finished_at, c.ctid FROM flow._commands c
             WHERE c.id > start AND c.id < bound AND c.id = c.run_id
             ORDER BY c.id LIMIT max_runs)) w
        GROUP BY w.id ORDER BY w.id LIMIT max_runs) x;
    last := seen[cardinality(seen)];
    -- which of the runs with a row ended (finished runs never change again,
    -- so what ended here is still ended below)
    SELECT array_agg(v.id) INTO ended_ids FROM flow._run_rows v
    WHERE v.id = ANY (with_row) AND v.status <> 'running' AND v.finished_at < cut;
    WITH run_rows AS (
        DELETE FROM flow._runs r WHERE r.id = ANY (ended_ids)
    ), alone AS (
        -- (by where the window read each root, a TID scan: 1.9 ms for 5,000
        -- under EXPLAIN ANALYZE, where finding them by id in the primary key
        -- took 4.6 of the statement's 9.3 ms. Only prune deletes a
        -- command and a finished one never changes, so that row is still the
        -- root read: a row put in its place would have finished after the cut)
        DELETE FROM flow._commands c
        WHERE c.ctid = ANY (alone_at) AND c.id = c.run_id AND c.finished_at < cut
        RETURNING c.id, c.status, c.attempts, c.lease_token, c.parent_id, c.run_id
    ), of_rows AS (
        -- (each run's commands by a subquery on its id, not a lateral join:
        -- see flow._commands_of)
        DELETE FROM flow._commands c
        WHERE c.id = ANY (ARRAY(SELECT unnest(ARRAY(SELECT k.id FROM flow._commands_of(gone.id) k))
                                FROM unnest(ended_ids) AS gone(id)))
        RETURNING c.id, c.status, c.attempts, c.lease_token, c.parent_id, c.run_id
    ), commands AS (
        SELECT c.id, c.parent_id IS NULL AS root,
               -- (a success at its first attempt, settled by 0.2.0 on, has no
               -- row in _attempts: see sql/schema.sql; 0.1.0 left the command
               -- no lease token)
               NOT (c.status = 'succeeded' AND c.attempts = 1 AND c.lease_token IS NOT NULL) AS attempted_before,
               c.id <> c.run_id AS may_wait   -- (a run's root waits for nothing)
        FROM (SELECT * FROM alone UNION ALL SELECT * FROM of_rows) c
    ), attempts AS (
        -- (the common run, one command that succeeded at once, probes neither)
        DELETE FROM flow._attempts a USING commands WHERE commands.attempted_before AND a.command_id = ANY (ARRAY[commands.id])
    ), waits AS (
        DELETE FROM flow._waits w USING commands WHERE commands.may_wait AND w.command_id = ANY (ARRAY[commands.id])
    )
    -- (every run has one root: its runs pruned here, not by a concurrent prune)
    SELECT count(*) FILTER (WHERE commands.root) INTO pruned FROM commands;
    PERFORM flow._observe('pruned_runs', pruned);
END $$;

-- Retire up to max_events journal entries emitted more than `older_than` ago
-- that no wait refers to. Open waits are satisfied when an event is emitted,
-- so only waits spawned later could still read an old entry: that is what
-- flow.event_retention bounds. (index _events_name_key is not needed: the
-- scan is by position, which grows with emitted_at.)
CREATE FUNCTION flow._retire_events(older_than interval, max_events integer) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    retired integer;
    old_events bigint[];
BEGIN
    PERFORM flow._commit_without_flush();   -- (as flow._prune's)
    PERFORM flow._compress_page_images();
    PERFORM set_config('flow_internal.retiring_events', 'on', true);
    -- An event goes only under its key's bucket lock (flow._lock_event_bucket):
    -- a wait being created on a key of the bucket keeps it this pass (it may
    -- refer to it); one created after waits for this pass to commit, and does
    -- not find it.
    -- (A statement of its own, then the deletion in the next: its snapshot
    -- sees the waits that were committed before the locks were taken.)
    SELECT array_agg(x.position) INTO old_events
    FROM (SELECT x.position, x.name, x.key FROM flow._events x
          WHERE x.emitted_at < now() - older_than
            AND NOT EXISTS (SELECT 1 FROM flow._waits w WHERE w.event_position = x.position)   -- index _waits_event
          ORDER BY x.position LIMIT max_events) x
    WHERE flow._lock_event_bucket(x.name, x.key, true, false);
    DELETE FROM flow._events e
    WHERE e.position = ANY (old_events)
      AND NOT EXISTS (SELECT 1 FROM flow._waits w WHERE w.event_position = e.position);
    GET DIAGNOSTICS retired = ROW_COUNT;
    PERFORM set_config('flow_internal.retiring_events', 'off', true);
    RETURN retired;
END $$;
