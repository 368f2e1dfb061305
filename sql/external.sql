-- External workers: claims with leases, heartbeats and settlements from outside the server.

-- Whether a succeeded command succeeded under lease_token: it keeps the
-- token of its successful attempt (kept_token); one settled by 0.1.0 has
-- an attempt row instead.
CREATE FUNCTION flow._succeeded_under(command_id uuid, kept_token uuid, lease_token uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(kept_token = lease_token, false)
        OR EXISTS (SELECT 1 FROM flow._attempts a WHERE a.command_id = _succeeded_under.command_id
                   AND a.lease_token = _succeeded_under.lease_token AND a.outcome = 'succeeded')
$$;

-- The attempt this transaction holds command_id in for caller under
-- lease_token (flow.claim's hold) and has not settled; NULL: none.
-- (plpgsql: the function it calls is written by pgrx, after this file)
CREATE FUNCTION flow._holding_attempt(caller oid, command_id uuid, lease_token uuid) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (flow._holding_attempts(caller, ARRAY[command_id], ARRAY[lease_token]))[1];
END $$;

-- The running command behind an external lease, locked, after checking the
-- caller may resolve it. A wrong or stale token is FL013; a command already
-- settled under this very token is FL017 (double completion).
CREATE FUNCTION flow._leased(caller oid, command_id uuid, lease_token uuid) RETURNS flow._commands
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    owner_ oid;
BEGIN
    IF command_id IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'flow: command_id and lease_token must not be NULL' USING ERRCODE = 'FL002';
    END IF;
    -- Ownership first, without a lock: another role's command is reported
    -- missing at once, never after waiting for its run's lock.
    SELECT d.owner INTO owner_ FROM flow._commands x
    JOIN flow._definitions d ON d.name = x.name AND d.version = x.version WHERE x.id = command_id;
    IF NOT FOUND OR NOT pg_has_role(caller, owner_, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: no command with id %', command_id USING ERRCODE = 'FL014';
    END IF;
    PERFORM flow._lock_runs_of(ARRAY[command_id]);
    SELECT x.* INTO c FROM flow._commands x WHERE x.id = command_id FOR UPDATE;
    IF c.status = 'running' AND c.lease_token = _leased.lease_token AND c.lease_pid IS NULL THEN
        IF c.lease_expires_at < now() THEN
            RAISE EXCEPTION 'flow: the lease on command % expired at %', command_id, c.lease_expires_at
                USING ERRCODE = 'FL013';
        END IF;
        RETURN c;
    END IF;
    IF c.status = 'succeeded' AND flow._succeeded_under(c.id, c.lease_token, _leased.lease_token) THEN
        RAISE EXCEPTION 'flow: command % was already completed under this lease', command_id
            USING ERRCODE = 'FL017';
    END IF;
    RAISE EXCEPTION 'flow: lease token % does not hold command % (it is %)', lease_token, command_id, c.status
        USING ERRCODE = 'FL013', HINT = 'The lease expired or was never yours; claim the command again.';
END $$;

-- What became of an external attempt (the reference's ResolveCommandAttempt),
-- for a worker that lost the reply to a claim, heartbeat or settlement:
-- 'held' (the lease is yours, until lease_expires_at), 'expired' (its lease ran
-- out and nobody concluded it yet; it can no longer be settled, see
-- flow._leased: a claim or recovery concludes it as lease_lost), or
-- 'concluded' with the attempt's outcome ('succeeded', 'lease_lost', 'cancelled', ...).
CREATE FUNCTION flow._resolve(caller oid, command_id uuid, lease_token uuid)
RETURNS TABLE (state text, outcome text, lease_expires_at timestamptz)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
    owner_ oid;
    concluded text;
BEGIN
    SELECT * INTO c FROM flow._commands x WHERE x.id = command_id;
    SELECT d.owner INTO owner_ FROM flow._definitions d WHERE d.name = c.name AND d.version = c.version;
    IF NOT FOUND OR NOT pg_has_role(caller, owner_, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: no command with id %', command_id USING ERRCODE = 'FL014';
    END IF;
    IF flow._holding_attempt(caller, command_id, lease_token) IS NOT NULL THEN   -- (by this transaction: flow.claim's hold)
        RETURN QUERY SELECT 'held', NULL::text, NULL::timestamptz;
        RETURN;
    END IF;
    IF c.status = 'running' AND c.lease_token = _resolve.lease_token AND c.lease_pid IS NULL THEN
        RETURN QUERY SELECT CASE WHEN c.lease_expires_at >= now() THEN 'held' ELSE 'expired' END, NULL::text,
                            c.lease_expires_at;
        RETURN;
    END IF;
    IF c.status = 'succeeded' AND flow._succeeded_under(c.id, c.lease_token, _resolve.lease_token) THEN
        RETURN QUERY SELECT 'concluded', 'succeeded', NULL::timestamptz;
        RETURN;
    END IF;
    SELECT a.outcome INTO concluded FROM flow._attempts a
    WHERE a.command_id = _resolve.command_id AND a.lease_token = _resolve.lease_token;
    IF FOUND THEN
        RETURN QUERY SELECT 'concluded', concluded, NULL::timestamptz;
        RETURN;
    END IF;
    RAISE EXCEPTION 'flow: lease token % never held command %', lease_token, command_id USING ERRCODE = 'FL013';
END $$;

-- What an external claim does before flow._claim takes its commands (see
-- flow.claim): checks its arguments and the caller's right to the
-- definitions, and concludes their expired leases.
CREATE FUNCTION flow._prepare_external_claim(caller oid, names text[], worker text, max_count integer, lease interval,
    conclude_expired boolean DEFAULT true)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wanted text;
    expired record;
BEGIN
    PERFORM flow._require_name('worker', worker);
    IF names IS NULL OR cardinality(names) = 0 THEN
        RAISE EXCEPTION 'flow: names must list at least one definition' USING ERRCODE = 'FL002';
    END IF;
    IF max_count IS NULL OR max_count < 1 OR max_count > 10000 THEN
        RAISE EXCEPTION 'flow: max must be between 1 and 10000, got %', max_count USING ERRCODE = 'FL015';
    END IF;
    IF lease IS NULL THEN
        RAISE EXCEPTION 'flow: lease must be positive, got NULL' USING ERRCODE = 'FL005';
    END IF;
    PERFORM flow._require_span('lease', lease);
    FOREACH wanted IN ARRAY names LOOP
        IF NOT EXISTS (SELECT 1 FROM flow._definitions d WHERE d.name = wanted AND d.handler IS NULL) THEN
            RAISE EXCEPTION 'flow: no external definition named %', wanted USING ERRCODE = 'FL001';
        END IF;
        IF EXISTS (SELECT 1 FROM flow._definitions d WHERE d.name = wanted AND d.handler IS NULL
                   AND NOT pg_has_role(caller, d.owner, 'MEMBER')) THEN
            RAISE EXCEPTION 'flow: no external definition named %', wanted USING ERRCODE = 'FL001';
        END IF;
    END LOOP;
    -- Expired external leases of these definitions are concluded first, so a
    -- server without in-database workers still retries them. (Not by a held
    -- claim: it needs the workers, whose recovery concludes them, and the
    -- locks it would take here would last for its client's transaction.)
    IF NOT conclude_expired THEN
        RETURN;
    END IF;
    FOR expired IN
        SELECT c.id, c.lease_token, c.attempt_deadline <= c.lease_expires_at AS timed_out
        FROM flow._commands c                                            -- index _commands_running, per queue
        WHERE c.status = 'running' AND c.queue = ANY (ARRAY(SELECT q.name FROM flow._queues q))
          AND c.lease_expires_at < now() AND c.lease_pid IS NULL AND c.name = ANY (names)
    LOOP
        CONTINUE WHEN NOT flow._try_lock_run_of(expired.id);
        PERFORM flow._conclude_expired_lease(expired.id, expired.lease_token, coalesce(expired.timed_out, false));
    END LOOP;
END $$;

-- Conclude an external lease that expired: lease_lost, or, when it ended at
-- the attempt's deadline (`timed_out`), timeout. The caller holds its run's lock.
CREATE FUNCTION flow._conclude_expired_lease(command_id uuid, lease_token uuid, timed_out boolean) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF timed_out THEN
        RETURN flow._settle_failure(command_id, lease_token, 'timeout', 'attempt_timeout',
                                    'the attempt''s deadline passed before the command was settled');
    END IF;
    RETURN flow._settle_failure(command_id, lease_token, 'lease_lost', 'lease_lost',
                                'the lease expired before the command was settled');
END $$;

-- Whether the attempt under lease_token was concluded by a cancel of its run.
CREATE FUNCTION flow._cancelled_under(caller oid, command_id uuid, lease_token uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM flow._attempts a JOIN flow._commands x ON x.id = a.command_id
                   WHERE a.command_id = _cancelled_under.command_id AND a.lease_token = _cancelled_under.lease_token
                     AND a.outcome = 'cancelled' AND pg_has_role(caller, x.owner, 'MEMBER'))
$$;

CREATE FUNCTION flow._heartbeat(caller oid, command_id uuid, lease_token uuid, extend interval)
RETURNS TABLE (lease_expires_at timestamptz, cancelled boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c flow._commands;
BEGIN
    PERFORM flow._require_span('extend', extend);
    -- Held by this transaction (flow.claim's hold): no lease to extend, and
    -- no cancel before the transaction ends (a cancel waits for its locks).
    IF flow._holding_attempt(caller, command_id, lease_token) IS NOT NULL THEN
        RETURN QUERY SELECT NULL::timestamptz, false;
        RETURN;
    END IF;
    -- A run cancelled (or failed) under a live lease: tell the worker to stop.
    IF flow._cancelled_under(caller, command_id, lease_token) THEN
        RETURN QUERY SELECT NULL::timestamptz, true;
        RETURN;
    END IF;
    BEGIN
        c := flow._leased(caller, command_id, lease_token);
    EXCEPTION WHEN SQLSTATE 'FL013' THEN
        -- (a cancel that committed while _leased waited for the run's lock)
        IF flow._cancelled_under(caller, command_id, lease_token) THEN
            RETURN QUERY SELECT NULL::timestamptz, true;
            RETURN;
        END IF;
        RAISE;
    END;
    -- (never past the attempt's deadline: its timeout, max_elapsed, the run's deadline)
    UPDATE flow._commands x SET
        lease_expires_at = least(now() + coalesce(extend, x.lease_interval), coalesce(x.attempt_deadline, 'infinity'))
    WHERE x.id = c.id
    RETURNING x.lease_expires_at INTO c.lease_expires_at;
    RETURN QUERY SELECT c.lease_expires_at, false;
END $$;

-- Settle an external success with its events and children, all in the caller's transaction.
CREATE FUNCTION flow._complete(caller oid, command_id uuid, lease_token uuid, result jsonb, events jsonb,
    children jsonb)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    held integer := flow._holding_attempt(caller, command_id, lease_token);
    c flow._commands;
    row_at tid;
    item jsonb;
BEGIN
    IF held IS NULL THEN
        c := flow._leased(caller, command_id, lease_token);
    ELSE
        -- held by this transaction's claim, which checked the caller's right
        -- and locked it (and its run, for a command not its run's root)
        SELECT * INTO c FROM flow._commands x WHERE x.id = command_id;
        SELECT x.ctid INTO row_at FROM flow._commands x WHERE x.id = command_id;
        IF c.status::text NOT IN ('pending', 'waiting') OR c.attempts <> held - 1 THEN
            -- (moved on in this very transaction: its run failed or was cancelled)
            RAISE EXCEPTION 'flow: lease token % does not hold command % (it is %)', lease_token, command_id, c.status
                USING ERRCODE = 'FL013';
        END IF;
    END IF;
    IF result IS NOT NULL THEN
        PERFORM flow._require_payload('result', result, false);
    END IF;
    IF events IS NOT NULL AND jsonb_typeof(events) <> 'array' OR children IS NOT NULL AND jsonb_typeof(children) <> 'array' THEN
        RAISE EXCEPTION 'flow: events and children must be JSON arrays' USING ERRCODE = 'FL003';
    END IF;
    FOR item IN SELECT * FROM jsonb_array_elements(coalesce(events, '[]')) LOOP
        PERFORM flow._emit(caller, c.id, item->>'name', item->>'key', coalesce(item->'payload', '{}'));
    END LOOP;
    FOR item IN SELECT * FROM jsonb_array_elements(coalesce(children, '[]')) LOOP
        PERFORM flow._spawn_many(caller, c.id, item->>'name', ARRAY[coalesce(item->'args', '{}')], ARRAY[item->>'key'],
            (item->>'start_after')::interval,
            (SELECT coalesce(array_agg(ROW(w->>'name', w->>'key')::flow.wait_spec), '{}')
             FROM jsonb_array_elements(coalesce(item->'waits', '[]')) w),
            (item->>'within')::interval, (item->>'version')::integer, item->>'queue', (item->>'priority')::integer,
            item->>'group_key', NULL);
    END LOOP;
    -- _leased holds the run's lock, as _settle_batch requires.
    IF held IS NULL THEN
        PERFORM flow._settle_batch(ARRAY[c.id], ARRAY[c.lease_token], ARRAY[result]);
    ELSE
        PERFORM flow._settle_batch(ARRAY[c.id], ARRAY[lease_token], ARRAY[result], ARRAY[now()], ARRAY[held],
                                   flow._holding_worker(), ARRAY[row_at]),
                flow._holding_settled(ARRAY[c.id]);
    END IF;
    RETURN 'succeeded';
END $$;

-- Settle many external successes in one call (results only: no events or
-- children). Returns each command's outcome: 'succeeded', or 'lease_lost'
-- when its token no longer holds it (nothing changed for that command), or
-- 'already_completed' for a second completion under the same token.
-- 'succeeded' means settled by this call: the commands are read without a
-- lock, and one that moves on before the settlement locks it (a cancel
-- committed meanwhile, its lease concluded as lost by a claim, the same
-- completion made by another call) is not settled. Every command not
-- settled is read again, after the settlement, and reported as it then is.
-- (Generic plans, as flow._settle_batch's: every statement is driven by the
-- ids given; a custom plan per call planned them all again, 150 us of a
-- call's 270 with nothing to settle, 0.5 us per command of a client's 100.)
CREATE FUNCTION flow._complete_many(caller oid, command_ids uuid[], lease_tokens uuid[], results jsonb[])
RETURNS TABLE (command_id uuid, status text)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    bad record;
    not_yours uuid;
    runs uuid[];
    ids uuid[];
    tokens uuid[];
    outcomes text[];
    -- the attempts of the commands this transaction holds (flow.claim's hold), aligned; NULL: none
    held_attempts integer[] := flow._holding_attempts(caller, command_ids, lease_tokens);
    settled uuid[];
BEGIN
    IF command_ids IS NULL OR lease_tokens IS NULL
       OR cardinality(command_ids) <> cardinality(lease_tokens)
       OR (results IS NOT NULL AND cardinality(results) <> cardinality(command_ids)) THEN
        RAISE EXCEPTION 'flow: command_ids, lease_tokens and results must be arrays of the same length'
            USING ERRCODE = 'FL003';
    END IF;
    SELECT t.i, t.result INTO bad FROM unnest(results) WITH ORDINALITY AS t(result, i)
    WHERE octet_length(t.result::text) > flow._max_payload_bytes() LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'flow: results[%] is over flow.max_result_bytes', bad.i USING ERRCODE = 'FL004';
    END IF;
    -- (a result for each command from here on: NULL for none)
    results := coalesce(results, array_fill(NULL::jsonb, ARRAY[cardinality(command_ids)]));
    -- Every command held by this transaction's claims for the caller (the
    -- call of a client that claims with hold): the claims checked the
    -- caller's right, took the runs' locks and keep the rows where they
    -- were, so the settlement writes them with no read first.
    IF held_attempts IS NOT NULL AND array_position(held_attempts, NULL) IS NULL THEN
        settled := flow._settle_batch(command_ids, lease_tokens, results,
                                      array_fill(now(), ARRAY[cardinality(command_ids)]), held_attempts,
                                      flow._holding_worker(), flow._holding_rows(command_ids)::tid[], false);
        IF cardinality(settled) < cardinality(command_ids) THEN
            -- A command this transaction moved since its claim (an emit that
            -- made a held waiting command pending) is no longer at the row the
            -- claim noted: settled again where it is now (its lock is this
            -- transaction's, so nothing else moved it; one it ended, cancelled
            -- or failed with its run, stays unsettled)
            settled := settled || (
                SELECT flow._settle_batch(array_agg(t.id), array_agg(t.token), array_agg(t.result),
                                          array_agg(now()), array_agg(t.attempt), flow._holding_worker(),
                                          array_agg(c.ctid), false)
                FROM unnest(command_ids, lease_tokens, results, held_attempts) AS t(id, token, result, attempt)
                JOIN flow._commands c ON c.id = ANY (ARRAY[t.id])   -- (a probe per command: sql/common.sql)
                WHERE t.id <> ALL (settled));
        END IF;
        ids := command_ids;
        tokens := lease_tokens;
        outcomes := CASE WHEN cardinality(settled) = cardinality(command_ids)
                         THEN array_fill('succeeded'::text, ARRAY[cardinality(command_ids)])
                         ELSE ARRAY(SELECT CASE WHEN t.id = ANY (settled) THEN 'succeeded' END
                                    FROM unnest(command_ids) AS t(id)) END;
    ELSE
        -- One read of each command: whether the caller may settle it, and the
        -- runs to lock first (_lock_runs_of's lock; a root with no child leaves
        -- its run unlocked: its success is the run's end and writes no run, and a
        -- cancel waits for the root's own row instead, see flow._run_rows).
        SELECT (array_agg(t.id) FILTER (WHERE d.owner IS NULL OR NOT pg_has_role(caller, d.owner, 'MEMBER')))[1],
               array_agg(DISTINCT c.run_id) FILTER (WHERE NOT (c.id = c.run_id
                   AND NOT EXISTS (SELECT 1 FROM flow._commands k WHERE k.parent_id = c.id)))  -- alone: docs/DESIGN.md
        INTO not_yours, runs
        FROM unnest(command_ids) AS t(id)
        LEFT JOIN flow._commands c ON c.id = t.id
        LEFT JOIN flow._definitions d ON d.name = c.name AND d.version = c.version;
        IF not_yours IS NOT NULL THEN
            RAISE EXCEPTION 'flow: no command with id %', not_yours USING ERRCODE = 'FL014';
        END IF;
        IF runs IS NOT NULL THEN
            PERFORM flow._lock_runs(runs);
        END IF;
        WITH item AS (
            -- held: this transaction's claim locked it (its settlement writes the
            -- claim's attempt too, at the row the lock kept in place); leased: the
            -- lease is still the token's
            SELECT t.id, t.token, t.result, t.attempt, c.ctid AS row_at,
                   CASE WHEN t.attempt IS NOT NULL THEN now() END AS started,
                   (t.attempt IS NOT NULL
                    OR c.status = 'running' AND c.lease_token = t.token AND c.lease_pid IS NULL
                       AND c.lease_expires_at >= now()) AS settleable
            FROM unnest(command_ids, lease_tokens, results, held_attempts) AS t(id, token, result, attempt)
            JOIN flow._commands c ON c.id = ANY (ARRAY[t.id])   -- (a probe per command: sql/common.sql)
        ), settled AS (
            -- (a held root's first attempt spawned nothing: only flow.complete
            -- spawns for an external command, and it settles the command too)
            SELECT coalesce(flow._settle_batch(array_agg(i.id), array_agg(i.token), array_agg(i.result),
                                               array_agg(i.started), array_agg(i.attempt), flow._holding_worker(),
                                               array_agg(i.row_at), false), '{}') AS ids
            FROM item i WHERE i.settleable
        )
        -- (the aggregates of one statement take its rows in the same order: the
        -- arrays stay aligned)
        SELECT array_agg(i.id), array_agg(i.token),
               array_agg(CASE WHEN i.settleable AND i.id = ANY (s.ids) THEN 'succeeded' END)   -- (NULL: read again below)
        INTO ids, tokens, outcomes
        FROM item i, settled s;
    END IF;
    -- (noted for the transaction's end: settled, not abandoned)
    IF held_attempts IS NOT NULL THEN
        PERFORM flow._holding_settled(ARRAY(SELECT t.id FROM unnest(ids, outcomes) AS t(id, outcome)
                                         WHERE t.outcome = 'succeeded'));
    END IF;
    -- (a statement of its own: its snapshot sees what the settlement waited for)
    IF array_position(outcomes, NULL) IS NOT NULL THEN
        SELECT array_agg(coalesce(t.outcome,
                   CASE WHEN EXISTS (SELECT 1 FROM flow._commands c
                                     WHERE c.id = t.id AND c.status = 'succeeded'
                                       AND flow._succeeded_under(c.id, c.lease_token, t.token))
                        THEN 'already_completed' ELSE 'lease_lost' END))
        INTO outcomes
        FROM unnest(ids, tokens, outcomes) AS t(id, token, outcome);
    END IF;
    RETURN QUERY SELECT * FROM unnest(ids, outcomes);
END $$;

CREATE FUNCTION flow._fail_external(caller oid, command_id uuid, lease_token uuid, message text,
    retry_after interval, permanent boolean, code text)
RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    held integer := flow._holding_attempt(caller, command_id, lease_token);
    outcome text;
BEGIN
    PERFORM flow._require_span('retry_after', retry_after);
    IF held IS NULL THEN
        PERFORM flow._leased(caller, command_id, lease_token);
    END IF;
    -- (held: by this transaction's claim, which checked the caller's right)
    outcome := flow._settle_failure(command_id, lease_token,
        CASE WHEN permanent THEN 'permanent' WHEN retry_after IS NOT NULL THEN 'retry_after' ELSE 'retryable' END,
        coalesce(code, CASE WHEN permanent THEN 'permanent' ELSE 'worker_error' END),
        coalesce(message, 'failed by its external worker'), retry_after,
        CASE WHEN held IS NOT NULL THEN now() END, held, flow._holding_worker());
    IF held IS NOT NULL THEN
        IF outcome NOT IN ('retry', 'failed') THEN
            -- (moved on in this very transaction: its run failed or was cancelled)
            RAISE EXCEPTION 'flow: lease token % does not hold command %', lease_token, command_id
                USING ERRCODE = 'FL013';
        END IF;
        PERFORM flow._holding_settled(ARRAY[command_id]);
    END IF;
    RETURN outcome;
END $$;
