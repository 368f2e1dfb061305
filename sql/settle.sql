-- Settle: concluding attempts, successes in batches and failures one by one,
-- with the retry policy (rules 5-7).

-- Cut a message to at most 1 KiB of UTF-8 without splitting a character.
CREATE FUNCTION flow._cut_message(message text) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cut text := left(message, 1024);
BEGIN
    WHILE octet_length(cut) > 1024 LOOP
        cut := left(cut, length(cut) - greatest(1, (octet_length(cut) - 1024) / 4));
    END LOOP;
    RETURN cut;
END $$;

-- Lock runs, in id order (so two lockers never deadlock): their rows, and
-- for a run without a row (see flow._runs) its root's row, which stands for
-- it, waiting for runs locked elsewhere. (Without waiting, one run:
-- flow._try_lock_run_of.)
-- (generic plans: custom ones, which PostgreSQL keeps choosing for
-- `= ANY (run_ids)`, planned both queries at every call, 0.2 ms a settlement)
CREATE FUNCTION flow._lock_runs(run_ids uuid[]) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    IF coalesce(cardinality(run_ids), 0) = 0 THEN
        RETURN;
    END IF;
    PERFORM 1 FROM flow._runs r WHERE r.id = ANY (run_ids) ORDER BY r.id FOR UPDATE;
    PERFORM 1 FROM flow._commands c
    WHERE c.id = ANY (run_ids) AND NOT EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = c.id)
    ORDER BY c.id FOR UPDATE;
END $$;

-- Lock the runs of these commands (flow._lock_runs). Every settlement of a
-- run takes this lock first, so exactly one of them sees the run's last
-- command finish (rule 7). (An external completion of successes leaves the
-- run of a root with no child unlocked, and locks the others' itself:
-- flow._complete_many.)
-- (plpgsql, not sql: its plan is cached per session; an sql function called
-- from plpgsql is planned again on every call, ~70 µs.)
CREATE FUNCTION flow._lock_runs_of(command_ids uuid[]) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM flow._lock_runs(ARRAY(SELECT DISTINCT c.run_id FROM flow._commands c WHERE c.id = ANY (command_ids)));
END $$;

-- Lock the run of a command unless another transaction holds it (then
-- false): for work that can wait for a later round, such as concluding an
-- attempt whose owner is gone; a leased settlement tries it for a while
-- (src/settle.rs, lock_run_briefly).
-- (one statement: through flow._lock_runs, a try took 210 µs, and the 200
-- children of a fan-out settling at 8 workers tried 1.8 times each)
CREATE FUNCTION flow._try_lock_run_of(command_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    locked boolean;
BEGIN
    WITH run AS (SELECT c.run_id AS id FROM flow._commands c WHERE c.id = _try_lock_run_of.command_id),
    run_row AS (SELECT r.id FROM flow._runs r WHERE r.id = (SELECT run.id FROM run) FOR UPDATE SKIP LOCKED),
    -- (a run without a row: its root's row; a run whose row is locked
    -- elsewhere has a row, and its root is not taken)
    root_row AS (SELECT c.id FROM flow._commands c
                 WHERE c.id = (SELECT run.id FROM run) AND NOT EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = c.id)
                 FOR UPDATE SKIP LOCKED)
    SELECT EXISTS (SELECT 1 FROM run_row) OR EXISTS (SELECT 1 FROM root_row) INTO locked;
    RETURN locked;
END $$;

-- Close every unfinished command of a run (cancel, run failure, or the
-- run's deadline: reason 'deadline', the commands expire). An
-- attempt in progress gets an attempt row and is counted, leased or held
-- (a held one is known from its worker's shared memory, as the views know it:
-- say, a handler that cancels its own run); its worker's later settlement
-- finds no lease, or a command that moved on.
CREATE FUNCTION flow._close_open_commands(run_id uuid, reason text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    interrupted integer;
BEGIN
    WITH in_progress AS (
        SELECT c.id, c.attempts AS attempt, c.lease_token, c.lease_owner AS owner, c.attempt_started_at AS started_at
        FROM flow._commands_of(_close_open_commands.run_id) c WHERE c.status::text = 'running'   -- (sql/common.sql)
        UNION ALL
        -- held: by a live worker (its shared memory), or named by the record
        -- of a worker that stopped in it and is not concluded yet
        (SELECT DISTINCT ON (h.command_id) h.command_id, h.attempt, gen_random_uuid(), h.owner, h.started_at
         FROM (SELECT h.command_id, h.attempt, h.owner, h.started_at, 0 AS pick FROM flow._held_attempts h
               UNION ALL
               SELECT r.command_id, r.attempt, 'a stopped worker', clock_timestamp(), 1
               FROM flow._recorded_attempts() r) h
         JOIN flow._commands_of(_close_open_commands.run_id) c ON c.id = h.command_id
         WHERE c.status::text IN ('pending', 'waiting') AND c.attempts = h.attempt - 1
         ORDER BY h.command_id, h.pick)   -- (a live worker's entry first)
    ), counted AS (
        INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
            outcome, error_code, error_message)
        SELECT i.id, i.attempt, i.lease_token, i.owner, i.started_at, clock_timestamp(),
               CASE WHEN reason = 'deadline' THEN 'expired' ELSE 'cancelled' END,
               reason, 'the run ended while this attempt ran'
        FROM in_progress i
        RETURNING command_id, attempt
    ), closed AS (
        UPDATE flow._commands c SET
            status = CASE WHEN reason = 'deadline' THEN 'expired' ELSE 'cancelled' END::flow.command_status,
            stop_reason = reason, finished_at = clock_timestamp(),
            attempts = coalesce((SELECT k.attempt FROM counted k WHERE k.command_id = c.id), c.attempts),
            lease_token = NULL, lease_owner = NULL, lease_pid = NULL, lease_backend_start = NULL,
            lease_expires_at = NULL, lease_interval = NULL, attempt_started_at = NULL, attempt_deadline = NULL
        WHERE c.id = ANY (ARRAY(SELECT k.id FROM flow._commands_of(_close_open_commands.run_id) k)) AND c.finished_at IS NULL
    )
    SELECT count(*) INTO interrupted FROM counted;
    PERFORM flow._observe(CASE WHEN reason = 'deadline' THEN 'attempts_expired' ELSE 'attempts_cancelled' END,
                          interrupted);
END $$;

-- Hand claimed commands back to their queue. One whose attempt never
-- started (a claim its worker did not reach in time, a chunk that failed
-- before it, a dead worker's lease its record does not name) gives back the
-- attempt the claim counted. One whose attempt started and that the engine
-- voided (`voided[i]`, the reason: 'demoted', a fast attempt cut at its
-- budget; 'engine_error', its chunk failed outside its handler; 'late_cancel',
-- a cancel signal meant for an attempt before it) keeps it, recorded as
-- 'voided': every attempt that started is counted (rule 3), and a voided one
-- is not charged against max_attempts (flow._settle_failure). Takes no run
-- lock and skips a command row locked elsewhere; returns those still held,
-- so the worker tries again later.
CREATE FUNCTION flow._release(command_ids uuid[], lease_tokens uuid[], voided text[] DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    released uuid[];
BEGIN
    WITH mine AS (
        SELECT c.id, t.void FROM flow._commands c
        JOIN unnest(command_ids, lease_tokens, voided) AS t(id, token, void) ON c.id = ANY (ARRAY[t.id])
        WHERE c.status::text = 'running' AND c.lease_token = t.token   -- by id (sql/common.sql)
        FOR UPDATE OF c SKIP LOCKED
    ), counted AS (
        INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
            outcome, error_code, error_message)
        SELECT c.id, c.attempts, c.lease_token, c.lease_owner, c.attempt_started_at, clock_timestamp(),
               'voided', m.void, flow._voided_message(m.void)
        FROM mine m JOIN flow._commands c ON c.id = ANY (ARRAY[m.id])
        WHERE m.void IS NOT NULL
    ), done AS (
        UPDATE flow._commands c SET status = 'pending',
            attempts = CASE WHEN mine.void IS NULL THEN c.attempts - 1 ELSE c.attempts END,
            lease_token = NULL, lease_owner = NULL, lease_pid = NULL, lease_backend_start = NULL,
            lease_expires_at = NULL, lease_interval = NULL, attempt_started_at = NULL, attempt_deadline = NULL
        FROM mine WHERE c.id = ANY (ARRAY[mine.id])
        RETURNING c.id
    )
    SELECT coalesce(array_agg(done.id), '{}') INTO released FROM done;
    PERFORM flow._observe('handed_back', cardinality(released)),
            flow._observe('attempts_voided', (SELECT count(*) FROM unnest(command_ids, voided) AS x(id, void)
                                               WHERE x.void IS NOT NULL AND x.id = ANY (released)));
    PERFORM flow._wake();
    RETURN QUERY
        SELECT c.id FROM flow._commands c JOIN unnest(command_ids, lease_tokens) AS t(id, token) ON c.id = ANY (ARRAY[t.id])
        WHERE c.status::text = 'running' AND c.lease_token = t.token AND c.id <> ALL (released);
END $$;

-- Why the engine voided an attempt (flow._release, flow._void_held).
CREATE FUNCTION flow._voided_message(code text) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE code
        WHEN 'demoted' THEN 'the attempt ran past the 100 ms budget of a fast handler: run again alone, not charged'
        WHEN 'engine_error' THEN 'the engine failed outside this attempt''s handler: run again, not charged'
        WHEN 'late_cancel' THEN 'a cancel meant for an earlier attempt stopped it: run again, not charged'
        WHEN 'crash' THEN 'its worker stopped later in the same transaction, which rolled it back: run again, not charged'
        WHEN 'cancelled' THEN 'its run was cancelled while it ran: counted, not charged'
        WHEN 'run_locked' THEN 'its run stayed locked elsewhere at its settlement: run again, not charged'
        ELSE code END
$$;

-- Void a held attempt that started (its command only locked, nothing
-- written): the attempt `attempt` is counted, recorded as 'voided' with the
-- reason `code` (see flow._release), and not charged. Changes nothing if the
-- command has moved on. Returns whether it voided it.
CREATE FUNCTION flow._void_held(command_id uuid, attempt integer, lease_token uuid, owner_name text,
    started timestamptz, code text)
RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE flow._commands c SET attempts = attempt,
        budget_started_at = flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at),
        wait_timed_out = flow._wait_timed_out(c.status, c.wait_timed_out)
    WHERE c.id = _void_held.command_id AND c.status::text IN ('pending', 'waiting') AND c.attempts = attempt - 1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
        outcome, error_code, error_message)
    VALUES (command_id, attempt, lease_token, owner_name, least(started, clock_timestamp()), clock_timestamp(),
            'voided', code, flow._voided_message(code));
    PERFORM flow._observe('attempts_voided', 1);
    RETURN true;
END $$;

-- Settle successful attempts in three set-based statements: a worker chunk's,
-- or one external completion. A succeeded command is the record of its
-- successful attempt (see sql/schema.sql, _attempts). The caller holds their
-- runs' locks (_lock_runs_of, the claim, _complete_many), but a root's with
-- no child, whose success writes no run (below). Returns the ids of the
-- commands it settled: a command the caller read as its own may have moved
-- on before this statement locked it (a cancel, a lease concluded as lost,
-- a second completion), and is then left as it is and not among them.
-- handler_started: when each handler started (in-database workers; NULL:
-- the attempt started at its claim), so an attempt's duration is its own.
-- held_attempts: for commands an in-database worker holds (see _claim), the
-- number of the attempt it made (NULL for leased ones), and owner_name the
-- worker: the claim's writes are made here, with the settlement's.
-- held_rows: where each held command's row is (its tid, from the claim that
-- locked it): the settlement writes it there, not through a probe of the
-- primary key for each (the lock kept the row where it was; a row this
-- transaction moved since, as a handler's cancel of its own run does, is not
-- there for it any more, and stays unsettled, as one whose status moved on).
-- chunk_spawned: whether any handler in the caller's transaction may have
-- spawned a command (an in-database worker knows, flow._note_spawn; true
-- when unknown): see `alone` below.
-- (Generic plans: every statement here is driven by the ids it is given,
-- whatever they are; a custom plan per call re-planned the statement that
-- completes runs of several commands, with its inlined _commands_of, for
-- half a millisecond per settlement, runs of one command or not.)
CREATE FUNCTION flow._settle_batch(command_ids uuid[], lease_tokens uuid[], results jsonb[],
    handler_started timestamptz[] DEFAULT NULL, held_attempts integer[] DEFAULT NULL, owner_name text DEFAULT NULL,
    held_rows tid[] DEFAULT NULL, chunk_spawned boolean DEFAULT true)
RETURNS uuid[]
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    settled uuid[];
    other_runs uuid[];
    old_root_runs uuid[];
    old_root_results jsonb[];
    finished integer;
    more integer;
BEGIN
    -- (the commands are looked up by id: their status is compared as text,
    -- see sql/common.sql)
    WITH item AS NOT MATERIALIZED (   -- (read by each branch below that runs, one for a chunk all held or all leased: not copied first)
        SELECT * FROM unnest(command_ids, lease_tokens, results, handler_started, held_attempts, held_rows)
                      AS t(id, token, result, started, held, row_at)
    ), leased_done AS (
        -- leased: the lease token must still be the command's. The command
        -- keeps the token, owner and start of its successful attempt: that is
        -- the attempt's record (no _attempts row; see sql/schema.sql).
        UPDATE flow._commands c SET status = 'succeeded', result = t.result, finished_at = clock_timestamp(),
            attempt_started_at = coalesce(t.started, c.attempt_started_at),
            lease_pid = NULL, lease_backend_start = NULL, lease_expires_at = NULL, lease_interval = NULL,
            attempt_deadline = NULL
        FROM item t
        WHERE c.id = ANY (ARRAY[t.id]) AND t.held IS NULL AND c.status::text = 'running' AND c.lease_token = t.token
          -- (one-time filters: a worker's chunk is all held or all leased,
          -- and the branch with none of its commands reads no item)
          AND (held_attempts IS NULL OR array_position(held_attempts, NULL) IS NOT NULL)
        RETURNING c.id, c.run_id, c.result, c.parent_id, NULL::integer AS held
    ), held_done AS (
        -- held (locked by this transaction's claim): the command must not have
        -- moved on (a cancel in the handler's own transaction); the writes the
        -- claim of a leased attempt makes are made here, with the attempt's record
        UPDATE flow._commands c SET status = 'succeeded', result = t.result, finished_at = clock_timestamp(),
            attempts = t.held, lease_token = t.token, lease_owner = owner_name, attempt_started_at = t.started,
            budget_started_at = flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at),
            wait_timed_out = flow._wait_timed_out(c.status, c.wait_timed_out)
        FROM item t
        -- (by its tid: a probe of the row per command, whatever the table's
        -- statistics; the id is compared as a filter the planner cannot join by)
        WHERE c.ctid = t.row_at AND NOT (c.id IS DISTINCT FROM t.id)
          AND t.held IS NOT NULL AND c.status::text IN ('pending', 'waiting')
          AND c.attempts = t.held - 1
          AND cardinality(array_remove(held_attempts, NULL)) > 0
        RETURNING c.id, c.run_id, c.result, c.parent_id, t.held
    ), done AS (
        SELECT d.*,
               -- a root without children: the run's only command (spawned ones descend
               -- from it). flow._run_rows recognizes such a run by the same test; the two
               -- must agree, or a run whose row is not written here is never seen ended
               -- (the places that make this test are listed there).
               -- A held root in its first attempt (none counted before) has no
               -- child unless a handler of this transaction spawned one, so
               -- it needs no probe: a child is spawned only by its parent's
               -- attempt (flow._spawn_many), and an attempt whose spawns were kept
               -- is counted (one given back by flow._release kept nothing of
               -- its transaction). The claim's held test takes the same step.
               d.parent_id IS NULL
               AND CASE WHEN d.held = 1 AND NOT chunk_spawned THEN true
                        ELSE NOT EXISTS (SELECT 1 FROM flow._commands k WHERE k.parent_id = d.id)  -- alone: docs/DESIGN.md
                   END AS alone
        FROM (SELECT * FROM leased_done UNION ALL SELECT * FROM held_done) d
        OFFSET 0   -- (kept a subquery: pulled up, its probe ran once per aggregate below, three times a command)
    )
    SELECT coalesce(array_agg(done.id), '{}'), array_agg(done.run_id) FILTER (WHERE NOT done.alone),
           count(*) FILTER (WHERE done.alone AND done.id = done.run_id),
           array_agg(done.run_id) FILTER (WHERE done.alone AND done.id <> done.run_id),
           array_agg(done.result) FILTER (WHERE done.alone AND done.id <> done.run_id)
    INTO settled, other_runs, finished, old_root_runs, old_root_results FROM done;
    -- The runs whose last command this was. A run of one command ended with
    -- its root, and its row is left alone: its end is the root's row (see
    -- flow._run_rows). What keeps a cancel from ending it meanwhile is the
    -- root's row lock (the claim's, or this settlement's): a cancel takes the
    -- run's unfinished commands before it reads whether the run ended
    -- (flow._lock_run_and_commands).
    -- A root made before 0.2.0 (its id is not its run's) still ends its run
    -- here, and other runs end once none of their commands is unfinished.
    IF old_root_runs IS NOT NULL THEN
        UPDATE flow._runs r SET status = 'succeeded', finished_at = clock_timestamp(), result = t.result
        FROM unnest(old_root_runs, old_root_results) AS t(id, result)
        WHERE r.id = ANY (ARRAY[t.id]) AND r.status = 'running';
        GET DIAGNOSTICS more = ROW_COUNT;
        finished := finished + more;
    END IF;
    IF other_runs IS NOT NULL THEN
        UPDATE flow._runs r SET status = 'succeeded', finished_at = clock_timestamp(),
            result = (SELECT c.result FROM flow._commands_of(r.id) c WHERE c.parent_id IS NULL)
        WHERE r.id = ANY (other_runs) AND r.status = 'running'
          -- (none of its commands unfinished: its root, by id; its children,
          -- by their own index, whatever the number finished; a root made
          -- before 0.2.0, by its key. Through flow._commands_of, the children
          -- were read in key order up to the first unfinished one: under the
          -- run's lock, 2.3 ms a settlement when 4,000 were half done.)
          AND NOT EXISTS (SELECT 1 FROM flow._commands c WHERE c.id = r.id AND c.finished_at IS NULL)
          AND NOT EXISTS (SELECT 1 FROM flow._commands c                  -- index _commands_open_children
                          WHERE c.run_id = r.id AND c.parent_id IS NOT NULL AND c.finished_at IS NULL)
          AND NOT EXISTS (SELECT 1 FROM flow._commands c                  -- index _commands_run_key
                          WHERE c.run_id = r.id AND c.key = 'root' AND c.id <> c.run_id AND c.finished_at IS NULL);
        GET DIAGNOSTICS more = ROW_COUNT;
        finished := finished + more;
    END IF;
    PERFORM flow._observe('attempts_succeeded', cardinality(settled)), flow._observe('runs_succeeded', finished);
    -- a limited queue may have room now (otherwise nobody is waiting for this)
    IF EXISTS (SELECT 1 FROM flow._queues q WHERE q.concurrency IS NOT NULL) THEN
        PERFORM flow._wake_due_from('infinity');   -- (room, nothing made due)
    END IF;
    RETURN settled;
END $$;

-- Settle a failed attempt and apply the retry policy (rules 5-6). outcome is
-- the class: permanent, retry_after, timeout, interrupted, lease_lost, crash,
-- retryable. Returns 'retry', 'failed', or 'expired' (lease not held: no change).
-- held_attempt: the command is not leased but held (see _claim), or was held
-- by a worker that stopped in its attempt (src/attempt_record.rs): the
-- attempt with this number is counted here, by `owner_name`, unless the
-- command has moved on since.
-- wait_for_run false: the caller's transaction holds the command (a worker's
-- chunk) and must not wait for its run's lock, which a cancel may hold while
-- it waits for the command (a root held without its run's lock, see _claim):
-- with the run locked elsewhere nothing is written and 'locked' returned,
-- the attempt left to that cancel.
CREATE FUNCTION flow._settle_failure(command_id uuid, lease_token uuid, outcome text, code text,
    message text, retry_delay interval DEFAULT NULL, handler_started timestamptz DEFAULT NULL,
    held_attempt integer DEFAULT NULL, owner_name text DEFAULT NULL, wait_for_run boolean DEFAULT true)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    d flow._definitions;
    next_at timestamptz;
    stop text;
    charged integer;
    cut text := flow._cut_message(coalesce(message, code));
BEGIN
    IF wait_for_run THEN
        PERFORM flow._lock_runs_of(ARRAY[command_id]);
    ELSIF NOT flow._try_lock_run_of(command_id) THEN
        RETURN 'locked';
    END IF;
    IF held_attempt IS NULL THEN
        -- (a lease concluded as lost was read as expired before this lock:
        -- a heartbeat committed meanwhile extended it, and it stands)
        SELECT * INTO c FROM flow._commands x
        WHERE x.id = _settle_failure.command_id AND x.status::text = 'running'   -- by id (sql/common.sql)
          AND x.lease_token = _settle_failure.lease_token
          AND (outcome <> 'lease_lost' OR x.lease_expires_at < now())
        FOR UPDATE;
    ELSIF wait_for_run THEN
        SELECT * INTO c FROM flow._commands x
        WHERE x.id = _settle_failure.command_id AND x.status::text IN ('pending', 'waiting')
          AND x.attempts = held_attempt - 1
        FOR UPDATE;
        IF NOT FOUND THEN
            RETURN 'expired';
        END IF;
    ELSE
        -- (a row locked by another transaction is not waited for either:
        -- 'locked'; one this transaction holds, a worker's chunk's, is read)
        SELECT * INTO c FROM flow._commands x
        WHERE x.id = _settle_failure.command_id AND x.status::text IN ('pending', 'waiting')
          AND x.attempts = held_attempt - 1
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN CASE WHEN EXISTS (SELECT 1 FROM flow._commands x
                                     WHERE x.id = _settle_failure.command_id
                                       AND x.status::text IN ('pending', 'waiting') AND x.attempts = held_attempt - 1)
                        THEN 'locked' ELSE 'expired' END;
        END IF;
    END IF;
    IF held_attempt IS NOT NULL THEN
        -- what the claim of a leased attempt would have written
        c.budget_started_at := flow._budget_start(c.status, c.attempts, c.next_run_at, c.budget_started_at);
        c.wait_timed_out := flow._wait_timed_out(c.status, c.wait_timed_out);
        c.attempts := held_attempt;
        c.lease_token := _settle_failure.lease_token;
        c.lease_owner := owner_name;
        c.attempt_started_at := coalesce(handler_started, clock_timestamp());
    END IF;
    IF NOT FOUND THEN
        RETURN 'expired';
    END IF;
    SELECT * INTO d FROM flow._definitions x WHERE x.name = c.name AND x.version = c.version;

    -- The attempts charged: not those the engine voided (flow._release),
    -- nor those before the command's last re-drive (flow._retry). The limit
    -- and the backoff count these alone.
    charged := c.attempts - c.attempt_base
               - (SELECT count(*) FROM flow._attempts a                    -- index _attempts_pkey
                  WHERE a.command_id = c.id AND a.attempt > c.attempt_base AND a.outcome = 'voided');
    IF outcome = 'permanent' THEN
        stop := 'permanent';
    ELSIF charged >= d.max_attempts THEN
        stop := 'attempt_limit';
    ELSE
        next_at := clock_timestamp() + CASE WHEN outcome = 'retry_after' AND retry_delay > interval '0' THEN retry_delay
                                ELSE flow._backoff(d.backoff, d.backoff_max, greatest(charged, 1)) END;
        IF next_at > flow._deadline(c.budget_started_at, d.max_elapsed) THEN
            stop := 'elapsed_limit';
        ELSIF c.deadline IS NOT NULL AND next_at >= c.deadline THEN
            stop := 'deadline_before_next_attempt';
        END IF;
    END IF;

    INSERT INTO flow._attempts (command_id, attempt, lease_token, owner, started_at, finished_at,
        outcome, error_code, error_message)
    VALUES (c.id, c.attempts, c.lease_token, c.lease_owner, coalesce(handler_started, c.attempt_started_at),
            clock_timestamp(), outcome, code, cut);
    PERFORM flow._observe('attempts_' || outcome, 1), flow._observe('stops_' || stop, 1);
    UPDATE flow._commands x SET
        status = CASE WHEN stop IS NULL THEN 'pending' ELSE 'failed' END::flow.command_status,
        attempts = c.attempts, budget_started_at = c.budget_started_at, wait_timed_out = c.wait_timed_out,
        next_run_at = coalesce(next_at, x.next_run_at),
        finished_at = CASE WHEN stop IS NULL THEN NULL ELSE clock_timestamp() END,
        stop_reason = stop, last_error_code = code, last_error_message = cut,
        lease_token = NULL, lease_owner = NULL, lease_pid = NULL, lease_backend_start = NULL,
        lease_expires_at = NULL, lease_interval = NULL, attempt_started_at = NULL, attempt_deadline = NULL
    WHERE x.id = c.id;

    IF stop IS NOT NULL THEN
        -- A terminal failure fails the run and cancels its other commands (rule 7).
        PERFORM flow._run_row_needed(c.run_id);   -- (its root is locked above)
        UPDATE flow._runs r SET status = 'failed', finished_at = clock_timestamp(),
            error = jsonb_build_object('command_id', c.id, 'command_key', c.key, 'name', c.name,
                                       'code', code, 'message', cut, 'stop_reason', stop)
        WHERE r.id = c.run_id AND r.status = 'running';
        IF FOUND THEN
            PERFORM flow._observe('runs_failed', 1);
        END IF;
        PERFORM flow._close_open_commands(c.run_id, 'run_failed');
    END IF;
    PERFORM flow._wake();
    RETURN CASE WHEN stop IS NULL THEN 'retry' ELSE 'failed' END;
END $$;
