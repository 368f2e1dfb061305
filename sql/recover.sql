-- Recover: concluding attempts whose owner is gone (rule 8), run by the
-- maintenance worker (src/recovery.rs). Nothing here waits for a lock: a
-- run or row locked elsewhere (a client idle in its transaction, a chunk
-- that holds a root) is tried without waiting (SKIP LOCKED, NOWAIT) and left,
-- in a subtransaction rolled back, for the next round. A wait without limit
-- here would stop every recovery, expiry and pruning behind one idle client.
-- (Not lock_timeout: the engine's statements run with query cancels held off,
-- src/spi.rs, and a lock timeout is one.)

-- Which of these worker processes (pid, backend start) are gone.
CREATE FUNCTION flow._gone_workers(pids integer[], started timestamptz[]) RETURNS boolean[]
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(array_agg(NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                                          WHERE a.pid = w.pid AND a.backend_start = w.started) ORDER BY w.i), '{}')
    FROM unnest(pids, started) WITH ORDINALITY AS w(pid, started, i)
$$;

-- Conclude, as interrupted, the attempt a gone worker's record names (see
-- src/attempt_record.rs): the attempt `attempt` of `command_id`, which the
-- worker (pid, started) had leased, or held (its row only locked, its
-- attempt not counted yet). Changes nothing if the command has moved on
-- (settled, or concluded already). Returns 'retry' or 'failed' (concluded),
-- 'expired' (moved on) or 'locked' (its run or row is locked elsewhere: try
-- again later).
CREATE FUNCTION flow._conclude_record(command_id uuid, attempt integer, pid integer, started timestamptz)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    message constant text := 'the worker running this attempt exited before settling it';
BEGIN
    SELECT * INTO c FROM flow._commands x WHERE x.id = _conclude_record.command_id;
    IF c.status::text = 'running' AND c.lease_pid = pid AND c.lease_backend_start = started
       AND c.attempts = attempt THEN
        RETURN flow._settle_failure(c.id, c.lease_token, 'interrupted', 'owner_died', message,
                                    wait_for_run => false);
    ELSIF c.status::text IN ('pending', 'waiting') AND c.attempts = attempt - 1 THEN
        RETURN flow._settle_failure(c.id, flow._new_id(), 'interrupted', 'owner_died', message,
                                    held_attempt => attempt, owner_name => current_database() || ':' || pid,
                                    wait_for_run => false);
    END IF;
    RETURN 'expired';
EXCEPTION WHEN lock_not_available THEN
    RETURN 'locked';
END $$;

-- One round of recovery. The writers of attempt records (pids[i], started[i]),
-- whether each was found gone (gone[i]), and for those gone what their record
-- names (recorded_commands[i], recorded_attempts[i]; NULL: no attempt):
-- * the attempt each gone worker's record names is charged, interrupted
--   (flow._conclude_record);
-- * the earlier attempts of a gone worker's open transaction (earlier_*:
--   writer index, command, attempt) ended, but their settlements rolled
--   back with that transaction: each is voided, code 'crash' (counted, not
--   charged; a leased one released, a held one by flow._void_held);
-- * the other commands a gone worker had leased never started their
--   attempt: they go back to their queues uncharged (flow._release). A lease of a worker that is gone
--   and wrote no record (after an OS crash lost the files) is charged, the
--   conservative side of rule 3; one of a worker that went after the
--   records were read waits for the next round;
-- * an external lease past its expiry is concluded as lease_lost.
-- Returns how many attempts it concluded, and for each writer whether its
-- record is done with (gone, and what it names concluded or moved on).
CREATE FUNCTION flow._recover(pids integer[], started timestamptz[], gone boolean[],
    recorded_commands uuid[], recorded_attempts integer[], earlier_writers integer[], earlier_commands uuid[],
    earlier_attempts integer[], OUT concluded integer, OUT records_done boolean[])
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    w record;
    e record;
    lost record;
    outcome text;
    entered flow._commands;
BEGIN
    concluded := 0;
    records_done := '{}';
    FOR w IN SELECT * FROM unnest(pids, started, gone, recorded_commands, recorded_attempts)
                          WITH ORDINALITY AS x(writer_pid, writer_started, writer_gone, command_id, attempt, i)
             ORDER BY x.i LOOP
        outcome := CASE WHEN NOT w.writer_gone THEN 'alive'
                        WHEN w.command_id IS NULL THEN 'expired'
                        ELSE flow._conclude_record(w.command_id, w.attempt, w.writer_pid, w.writer_started) END;
        records_done := records_done || (outcome NOT IN ('alive', 'locked'));
        concluded := concluded + (outcome IN ('retry', 'failed'))::integer;
    END LOOP;

    FOR e IN SELECT * FROM unnest(earlier_writers, earlier_commands, earlier_attempts) AS x(writer, command_id, attempt)
    LOOP
        CONTINUE WHEN NOT coalesce(gone[e.writer], false);
        BEGIN
            SELECT * INTO entered FROM flow._commands x WHERE x.id = e.command_id FOR UPDATE NOWAIT;
            IF entered.status::text = 'running' AND entered.lease_pid = pids[e.writer]
               AND entered.lease_backend_start = started[e.writer] AND entered.attempts = e.attempt THEN
                IF EXISTS (SELECT FROM flow._release(ARRAY[entered.id], ARRAY[entered.lease_token], ARRAY['crash'])) THEN
                    records_done[e.writer] := false;
                END IF;
            ELSIF entered.status::text IN ('pending', 'waiting') AND entered.attempts = e.attempt - 1 THEN
                PERFORM flow._void_held(entered.id, e.attempt, flow._new_id(),
                                        current_database() || ':' || pids[e.writer], clock_timestamp(), 'crash');
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            records_done[e.writer] := false;   -- (next round)
        END;
    END LOOP;

    FOR lost IN
        SELECT c.id, c.lease_token, c.lease_pid IS NULL AS external,
               coalesce(c.attempt_deadline <= c.lease_expires_at, false) AS timed_out,
               (SELECT bool_or(g.writer_gone) FROM unnest(pids, started, gone) AS g(writer_pid, writer_started, writer_gone)
                WHERE g.writer_pid = c.lease_pid AND g.writer_started = c.lease_backend_start) AS writer_gone,
               (SELECT min(g.i) FROM unnest(pids, started) WITH ORDINALITY AS g(writer_pid, writer_started, i)
                WHERE g.writer_pid = c.lease_pid AND g.writer_started = c.lease_backend_start) AS writer
        FROM flow._commands c                                       -- index _commands_running
        WHERE c.status = 'running'
          AND CASE WHEN c.lease_pid IS NULL THEN c.lease_expires_at < now()
                   ELSE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                                    WHERE a.pid = c.lease_pid AND a.backend_start = c.lease_backend_start) END
    LOOP
        IF NOT lost.external THEN
            -- (named by its worker's record: concluded above, or on a later round)
            CONTINUE WHEN lost.id = ANY (recorded_commands) OR lost.writer_gone IS false;
            IF lost.writer_gone THEN
                -- A row locked elsewhere is released on a later round, and
                -- its writer's record kept until then: without it, that lease
                -- would be taken for one an OS crash left, and charged.
                IF EXISTS (SELECT FROM flow._release(ARRAY[lost.id], ARRAY[lost.lease_token])) THEN
                    records_done[lost.writer] := false;
                END IF;
                CONTINUE;
            END IF;
        END IF;
        BEGIN
            -- a run locked elsewhere (an external client idle in its transaction, a
            -- long chunk) is concluded on a later round, never waited for
            CONTINUE WHEN NOT flow._try_lock_run_of(lost.id);
            IF lost.external THEN
                outcome := flow._conclude_expired_lease(lost.id, lost.lease_token, lost.timed_out);
            ELSE
                outcome := flow._settle_failure(lost.id, lost.lease_token, 'interrupted', 'owner_died',
                                                'the worker running this attempt exited before settling it');
            END IF;
            concluded := concluded + (outcome <> 'expired')::integer;
        EXCEPTION WHEN lock_not_available THEN
            NULL;   -- (its row, or a run the lock found taken meanwhile: next round)
        END;
    END LOOP;
END $$;

-- End the runs whose deadline has passed (rule 6): each one fails with
-- stop_reason 'deadline', and its unfinished commands expire (an attempt in
-- progress is counted, outcome 'expired'; an in-database handler still in
-- it is cut off by its own deadline, which is never later than the run's).
-- Without this a run whose child is due after the deadline, or whose
-- external command nobody claims, would stay running. A run locked
-- elsewhere, or one of its commands (a held root's chunk, a client's held
-- claim), is left for the next round: their locks are tried without waiting,
-- in a subtransaction rolled back if one is taken (a held root that
-- succeeds meanwhile then ends its run as it should).
-- Earliest deadlines first. Returns how many runs ended.
CREATE FUNCTION flow._expire_runs() RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    late uuid;
    ended integer := 0;
BEGIN
    FOR late IN
        SELECT c.run_id FROM flow._commands c                       -- index _commands_deadline
        WHERE c.finished_at IS NULL AND c.deadline IS NOT NULL AND c.deadline <= now()
        ORDER BY c.deadline
        LIMIT 1000
    LOOP
        BEGIN
            CONTINUE WHEN NOT flow._try_lock_run_of(late);
            -- (its commands first, as a cancel takes them, then the check under the
            -- locks: still past its deadline with something unfinished)
            PERFORM 1 FROM flow._commands c
            WHERE c.id = ANY (ARRAY(SELECT k.id FROM flow._commands_of(late) k WHERE k.finished_at IS NULL))
            ORDER BY c.id FOR UPDATE OF c NOWAIT;
            CONTINUE WHEN NOT EXISTS (SELECT 1 FROM flow._commands_of(late) c
                                      WHERE c.finished_at IS NULL AND c.deadline <= now());
            PERFORM flow._run_row_needed(late);
            UPDATE flow._runs r SET status = 'failed', finished_at = clock_timestamp(),
                error = jsonb_build_object('code', 'deadline', 'message', 'the run''s deadline passed',
                                           'stop_reason', 'deadline', 'deadline', r.deadline)
            WHERE r.id = late AND r.status = 'running';
            IF FOUND THEN
                ended := ended + 1;
            END IF;
            PERFORM flow._close_open_commands(late, 'deadline');
            PERFORM flow._interrupt_run(late);
        EXCEPTION WHEN lock_not_available THEN
            NULL;   -- (next round)
        END;
    END LOOP;
    PERFORM flow._observe('runs_failed', ended), flow._observe('stops_deadline', ended);
    RETURN ended;
END $$;
