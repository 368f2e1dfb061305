-- Workflows: run control (cancel, await), events, waits, children and the run graph.

-- Lock a run, then its unfinished commands: a chunk holding a root that has
-- no child yet holds the root and not the run (flow._claim); once the root
-- is had too, whatever that chunk settled is seen by the next statement.
-- (The run first: everyone else who locks a run's commands and then the run
-- holds the run already, or takes it only if it is free.)
CREATE FUNCTION flow._lock_run_and_commands(run_id uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM 1 FROM flow._runs x WHERE x.id = run_id FOR UPDATE;
    PERFORM 1 FROM flow._commands c
    WHERE c.id = ANY (ARRAY(SELECT k.id FROM flow._commands_of(_lock_run_and_commands.run_id) k WHERE k.finished_at IS NULL))
    ORDER BY c.id FOR UPDATE OF c;
END $$;

CREATE FUNCTION flow._cancel(caller oid, run_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    started timestamptz := clock_timestamp();
    stopped boolean := false;
BEGIN
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    PERFORM flow._require_member(caller, r.owner, 'run', run_id);
    -- A worker chunk running this run's commands holds its lock, or (a root
    -- with no child yet, see flow._claim) its root's: interrupt the handler
    -- so the lock comes free and nothing is settled as success (the worker
    -- hands the command back, whatever attempt it was on).
    PERFORM flow._interrupt_run(run_id);
    LOOP
        BEGIN
            PERFORM set_config('lock_timeout', CASE WHEN stopped THEN '0' ELSE '3s' END, true);
            PERFORM flow._lock_run_and_commands(run_id);
            -- Whoever held the run's commands may have given the run its row
            -- meanwhile (a root's chunk that spawned, or failed): it is locked
            -- too, without waiting while the commands are held (a settlement
            -- takes the run, then the command: that wait could deadlock), or
            -- the commands' locks are given back and all taken again.
            PERFORM 1 FROM flow._runs x WHERE x.id = run_id FOR UPDATE NOWAIT;
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            -- (rolled back: the commands' locks are given back) A handler of the
            -- run that ignores the cancel for 3 s has its worker stopped
            -- (recovery concludes that attempt); then whoever else holds the
            -- run is waited for.
            IF NOT stopped AND clock_timestamp() - started >= interval '3 s' THEN
                PERFORM flow._stop_workers_of(run_id);
                stopped := true;
            END IF;
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', '0', true);
    -- (as it stands now that it is locked: it may have ended with its root,
    -- or, ended long ago, been deleted by retention while the lock was awaited)
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    IF NOT FOUND OR r.status <> 'running' THEN
        RETURN false;
    END IF;
    PERFORM flow._run_row_needed(run_id);   -- (its root is locked above)
    UPDATE flow._runs x SET status = 'cancelled', finished_at = now() WHERE x.id = run_id AND x.status = 'running';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM flow._close_open_commands(run_id, 'cancelled');
    PERFORM flow._observe('runs_cancelled', 1);
    PERFORM flow._wake();   -- a limited queue may have room now
    RETURN true;
END $$;

-- Re-drive (flow.retry): the failed and cancelled commands of a failed or
-- cancelled run become due again, each with a fresh attempt budget (its
-- attempts so far become its attempt_base: max_attempts, the backoff and
-- max_elapsed count from now; attempt numbers and their history go on), and
-- the run is running again. A command that never ran and still waits for an
-- event waits again, for its `within` from now. Expired commands are not
-- re-driven: a run past its deadline cannot run again (FL007). The caller
-- needs the rights flow.cancel needs. No handler of an ended run runs, so
-- its locks are taken in cancel's order without waiting on a handler.
CREATE FUNCTION flow._retry(caller oid, run_id uuid) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    redriven integer;
    used record;
    q flow._queues;
BEGIN
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    PERFORM flow._require_member(caller, r.owner, 'run', run_id);
    PERFORM flow._lock_run_and_commands(run_id);
    PERFORM 1 FROM flow._runs x WHERE x.id = run_id FOR UPDATE;
    -- (as it stands now that it is locked: a concurrent re-drive, or retention)
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    IF NOT FOUND OR r.status NOT IN ('failed', 'cancelled') THEN
        RETURN false;
    END IF;
    IF r.deadline IS NOT NULL AND r.deadline <= now() THEN
        RAISE EXCEPTION 'flow: run % passed its deadline at %; it cannot run again', run_id, r.deadline
            USING ERRCODE = 'FL007';
    END IF;
    -- The queues of the commands made unfinished again are held, as an
    -- enqueue holds its queue (flow._hold_queue): one dropped since they
    -- ended is refused (a command in it would never run), and their
    -- priorities are noted again (flow._retire_priorities forgets those no
    -- unfinished command has, as it may have since these ended).
    FOR used IN SELECT DISTINCT k.queue, k.priority, k.group_hash <> 0 AS grouped
                FROM flow._commands_of(_retry.run_id) k WHERE k.status IN ('failed', 'cancelled') LOOP
        IF NOT EXISTS (SELECT 1 FROM flow._queues x WHERE x.name = used.queue) THEN
            RAISE EXCEPTION 'flow: run % has commands in queue %, which was dropped', run_id, used.queue
                USING ERRCODE = '42704', HINT = 'Make the queue again with flow.set_queue, then re-drive the run.';
        END IF;
        PERFORM flow._hold_queue(used.queue);   -- (40001 if dropped meanwhile)
        -- (read once held, as it now is: a queue dropped and made again by
        -- another role is that role's)
        SELECT * INTO q FROM flow._queues x WHERE x.name = used.queue;
        IF NOT flow._may_use_queue(r.owner, q) THEN
            RAISE EXCEPTION 'flow: run % has commands in queue %, which its owner may no longer use', run_id, used.queue
                USING ERRCODE = 'FL011', HINT = 'Ask the queue''s owner for flow.grant_queue(), then re-drive the run.';
        END IF;
        IF used.priority <> 0 OR used.grouped THEN
            PERFORM flow._note_priority(used.queue, used.priority, used.grouped);
        END IF;
    END LOOP;
    UPDATE flow._commands c SET
        status = CASE WHEN redo.waits THEN 'waiting' ELSE 'pending' END::flow.command_status,
        next_run_at = CASE WHEN redo.waits THEN least(coalesce(now() + (c.declaration->>'within')::interval, 'infinity'),
                                                   coalesce(c.deadline, 'infinity'))
                           ELSE greatest(c.not_before, now()) END,
        budget_started_at = greatest(c.not_before, now()),
        attempt_base = c.attempts,
        stop_reason = NULL, finished_at = NULL
    FROM (SELECT k.id, k.attempts = 0 AND EXISTS (SELECT 1 FROM flow._waits w
                                                  WHERE w.command_id = k.id AND w.event_position IS NULL) AS waits
          FROM flow._commands_of(_retry.run_id) k WHERE k.status IN ('failed', 'cancelled')) redo
    WHERE c.id = redo.id;
    GET DIAGNOSTICS redriven = ROW_COUNT;
    UPDATE flow._runs x SET status = 'running', finished_at = NULL, error = NULL, result = NULL
    WHERE x.id = run_id;
    PERFORM flow._observe('runs_retried', 1);
    PERFORM flow._observe('commands_retried', redriven);
    PERFORM flow._wake_due_from(now());
    RETURN true;
END $$;

-- Block until the run is terminal or the timeout passes (then status is
-- 'running'). Polls with a growing pause (1 ms → 50 ms); each poll is a new
-- snapshot, so call it outside a REPEATABLE READ transaction.
CREATE FUNCTION flow._await(caller oid, run_id uuid, timeout interval) RETURNS flow.run_outcome
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    give_up timestamptz;
    pause double precision := 0.001;
    first boolean := true;
BEGIN
    PERFORM flow._require_span('await timeout', timeout, zero_ok => true);
    give_up := clock_timestamp() + coalesce(timeout, interval '0');
    LOOP
        SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
        PERFORM flow._require_member(caller, r.owner, 'run', run_id);
        EXIT WHEN r.status <> 'running' OR clock_timestamp() >= give_up;
        -- A run this transaction enqueued (or made running again) cannot
        -- end before it commits, and one whose end this transaction's
        -- snapshot cannot see would not be seen to end: refused, not
        -- waited for until the timeout.
        IF first THEN
            first := false;
            IF EXISTS (SELECT 1 FROM flow._commands c WHERE c.id = _await.run_id AND flow._written_here(c.xmin::text::bigint)) THEN
                RAISE EXCEPTION 'flow: run % was enqueued or changed by this transaction, and cannot end before it commits', run_id
                    USING ERRCODE = '55000', HINT = 'Commit first, then call flow.await.';
            END IF;
            IF current_setting('transaction_isolation') <> 'read committed' THEN
                RAISE EXCEPTION 'flow: flow.await cannot see run % end in a % transaction', run_id,
                    current_setting('transaction_isolation')
                    USING ERRCODE = '55000', HINT = 'Call flow.await in a READ COMMITTED transaction, or outside one.';
            END IF;
        END IF;
        -- (woken by a commit that ends runs: src/shmem.rs, _await_pause)
        PERFORM flow._await_pause(least(pause, extract(epoch FROM give_up - clock_timestamp())));
        pause := least(pause * 2, 0.05);
    END LOOP;
    PERFORM flow._await_done();
    RETURN ROW(r.status, r.result, r.error)::flow.run_outcome;
END $$;

-- An emit and the creation of a wait on the same (name, key) serialize on
-- flow._lock_event_key (src/locks.rs: a lock tag of flow's own), so a
-- wait created while the event is being emitted is never missed by both
-- sides. The lock is per owner of the waiting runs (the "domain"), and an
-- emitter locks only the domains its event may satisfy (flow._may_satisfy):
-- a transaction left open after an emit holds up waits on that key in its
-- own role's runs, never in another role's. Emits share their locks, so they
-- never wait for each other. A superuser's event may satisfy every role's
-- waits: it takes the key's lock for all domains, which every wait creation
-- takes in a mode that does not conflict with other wait creations.
CREATE FUNCTION flow._lock_event_emit(name text, key text, emitter oid, emitter_run uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    domain oid;
BEGIN
    IF (SELECT a.rolsuper FROM pg_roles a WHERE a.oid = emitter) THEN
        PERFORM flow._lock_event_key(name, key, 0, 'share');
        RETURN;
    END IF;
    -- the owners whose waits _may_satisfy lets this event satisfy
    FOR domain IN
        SELECT a.oid FROM pg_roles a WHERE pg_has_role(emitter, a.oid, 'MEMBER')
        UNION
        SELECT r.owner::oid FROM flow._run_rows r WHERE r.id = emitter_run
        ORDER BY 1
    LOOP
        PERFORM flow._lock_event_key(name, key, domain, 'share');
    END LOOP;
END $$;

-- Before a wait on (name, key) is created in a run of run_owner (see above;
-- and its bucket's lock, against event retention: src/locks.rs).
CREATE FUNCTION flow._lock_event_waits(name text, key text, run_owner oid) RETURNS void
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    SELECT flow._lock_event_key(name, key, 0, 'row exclusive'),
           flow._lock_event_key(name, key, run_owner, 'exclusive'),
           flow._lock_event_bucket(name, key, false, true)
$$;

-- Mark the open waits of one command satisfied by the newest journal entries
-- and make it due when none is left open.
CREATE FUNCTION flow._promote_if_satisfied(command_id uuid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- Lock first, check in the next statement: its fresh snapshot sees every
    -- wait satisfied by emitters that committed while we waited for the lock.
    -- (A single UPDATE would re-check its NOT EXISTS with the old snapshot, and
    -- two concurrent emitters could each leave the command waiting forever.)
    PERFORM 1 FROM flow._commands c WHERE c.id = command_id AND c.status = 'waiting' FOR UPDATE;
    IF FOUND THEN
        UPDATE flow._commands c SET status = 'pending', next_run_at = greatest(c.not_before, now()),
            -- max_elapsed counts from when it first became due, not from its spawn
            budget_started_at = CASE WHEN c.attempts = 0 THEN greatest(c.not_before, now())
                                     ELSE c.budget_started_at END
        WHERE c.id = command_id AND c.status = 'waiting'
          AND NOT EXISTS (SELECT 1 FROM flow._waits w WHERE w.command_id = c.id AND w.event_position IS NULL);
    END IF;
END $$;

-- Whose events may satisfy a command's waits: those emitted inside its own
-- run (by any of its handlers or external workers), and those its run's owner
-- (or a member of it; a superuser) emitted. Another role can neither feed
-- inputs into a workflow it does not own, nor read its own events back
-- through one it spawned a definition of.
CREATE FUNCTION flow._may_satisfy(emitter_role oid, emitter_run uuid, command_id uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (
        SELECT 1 FROM flow._commands c
        WHERE c.id = command_id
          AND (c.run_id = emitter_run OR pg_has_role(emitter_role, c.owner, 'MEMBER')))
$$;

-- emitter: the command whose handler (or external worker) emits, NULL from outside.
CREATE FUNCTION flow._emit(caller oid, emitter uuid, name text, key text, payload jsonb) RETURNS bigint
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    pos bigint;
    waiting uuid;
    promoted uuid[];
    emitter_run uuid := (SELECT c.run_id FROM flow._commands c WHERE c.id = emitter);
BEGIN
    -- (the checks in a block of their own, which writes nothing: see _spawn_many)
    BEGIN
        PERFORM flow._require_name('event name', name);
        IF key IS NULL THEN
            RAISE EXCEPTION 'flow: event key must not be NULL' USING ERRCODE = 'FL002';
        END IF;
        PERFORM flow._require_short('event key', key);
        PERFORM flow._require_payload('event payload', payload, false);
    EXCEPTION WHEN SQLSTATE 'FL002' OR SQLSTATE 'FL003' OR SQLSTATE 'FL004' THEN
        -- inside a handler an invalid emit is an invalid decision (see _spawn_many)
        IF emitter IS NOT NULL THEN
            PERFORM flow._decide('invalid_decision', 'invalid_decision', SQLERRM, NULL);
        END IF;
        RAISE;
    END;
    PERFORM flow._lock_event_emit(name, key, caller, emitter_run);
    -- Inside a handler the event rides in the handler's transaction: it is
    -- journaled only if the attempt settles successfully.
    INSERT INTO flow._events (id, name, key, payload, owner, run_id, command_id)
    VALUES (flow._new_id(), name, key, payload, caller, emitter_run, emitter)
    RETURNING position INTO pos;
    PERFORM flow._observe('events', 1);
    -- The waiting commands are promoted (each locked) in id order: two emits
    -- of different events that satisfy waits of the same commands lock them
    -- in the same order, never in the order each one's waits were found in,
    -- which may be opposite and deadlock.
    WITH satisfied AS (
        UPDATE flow._waits w SET event_position = pos, satisfied_at = now()
        WHERE w.name = _emit.name AND w.key = _emit.key AND w.event_position IS NULL   -- index _waits_open
          AND flow._may_satisfy(caller, emitter_run, w.command_id)
        RETURNING w.command_id
    )
    SELECT array_agg(s.command_id ORDER BY s.command_id) INTO promoted FROM satisfied s;
    FOREACH waiting IN ARRAY coalesce(promoted, '{}') LOOP
        PERFORM flow._promote_if_satisfied(waiting);
    END LOOP;
    PERFORM flow._wake_due_from(now());   -- (a command promoted is due at now() or later)
    RETURN pos;
END $$;

-- An array of one dimension whose first index is 1, or empty, or NULL: what
-- a loop by index and unnest read alike. (SQL, inlined.)
CREATE FUNCTION flow._plain_array(a anyarray) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT a IS NULL OR cardinality(a) = 0 OR (array_ndims(a) = 1 AND array_lower(a, 1) = 1)
$$;

-- What a spawn declares, kept in _commands.declaration: a spawn of the same
-- key must declare the same (flow._spawn_many). `waits` is the waits as a
-- JSON array; `more` the priority when given. (SQL, inlined into the
-- statements that call it.)
CREATE FUNCTION flow._declaration(name text, version integer, args jsonb, queue text, start_after interval,
    within interval, waits jsonb, more jsonb, group_key text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('name', name, 'version', version, 'args', args, 'queue', queue,
                              'start_after', start_after, 'within', within, 'waits', waits) || more
           || CASE WHEN group_key IS NOT NULL THEN jsonb_build_object('group_key', group_key) ELSE '{}' END
$$;

-- parent_id: the command whose handler (or external worker) spawns; NULL is an
-- error. Spawns one child of `name` per element of args_list, under the key
-- at the same place in `keys` (and in the group at the same place in
-- group_keys, if given), with the same options; returns their ids in
-- that order (flow.spawn is a spawn of one). A fan-out of 200 children in
-- one call inserts them in one statement: 200 calls of a spawn of one took
-- 27-49 ms of its root's attempt, and its children could not start before.
CREATE FUNCTION flow._spawn_many(caller oid, parent_id uuid, name text, args_list jsonb[], keys text[],
    start_after interval, waits flow.wait_spec[], within interval, version integer, queue text,
    given_priority integer, group_key text, group_keys text[])
RETURNS uuid[]
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
-- (the ON CONFLICT below names columns run_id and key, which cannot be
-- qualified; every other use of a parameter or column here is qualified, or
-- has no column of that name in scope)
DECLARE
    parent flow._commands;
    p record;   -- flow._plan_enqueue's
    spec flow.wait_spec;
    declared_waits jsonb;
    declared_more jsonb;
    grouped boolean;
    children uuid[];
    inserted uuid[];   -- the children that are new, when some are not (NULL: all are)
    added integer;
    conflict text;
    journaled bigint;
    priority smallint;
    child uuid;
BEGIN
    SELECT * INTO parent FROM flow._commands c WHERE c.id = _spawn_many.parent_id AND c.finished_at IS NULL;  -- leased (running) or held by this worker
    IF NOT FOUND THEN
        RAISE EXCEPTION 'flow: spawn is only possible inside a running handler' USING ERRCODE = 'FL012',
            HINT = 'Use flow.enqueue to start a new run.';
    END IF;
    waits := coalesce(waits, '{}');
    -- The checks, in a block of their own: an invalid spawn is the handler's
    -- decision, and fails its command even if the handler catches the error
    -- (the first one counts, as the reference). The block writes nothing but
    -- a queue made on first use, so its subtransaction takes no transaction
    -- id: around the inserts too, a fan-out of 200 spawns took 200, and the
    -- subtransactions of more than 64 overflow every snapshot in the server.
    BEGIN
        IF args_list IS NULL OR keys IS NULL THEN
            RAISE EXCEPTION 'flow: spawn_many needs args_array and keys' USING ERRCODE = 'FL003';
        END IF;
        IF cardinality(args_list) <> cardinality(keys) THEN
            RAISE EXCEPTION 'flow: spawn_many needs as many keys (%) as args (%)', cardinality(keys),
                cardinality(args_list) USING ERRCODE = 'FL003';
        END IF;
        -- (read by index below, and by unnest in the insert: the two agree
        -- only on arrays of one dimension that start at 1)
        IF NOT flow._plain_array(keys) OR NOT flow._plain_array(args_list) OR NOT flow._plain_array(group_keys) THEN
            RAISE EXCEPTION 'flow: spawn_many takes arrays of one dimension, from index 1' USING ERRCODE = 'FL003';
        END IF;
        p := flow._plan_enqueue(caller, name, version, queue, start_after, NULL, NULL);
        priority := flow._priority(given_priority, p.def_priority);
        -- (one loop for both, by index: two FOREACH loops cost a spawn of
        -- one child 5-8 µs, 5 %)
        FOR i IN 1..cardinality(keys) LOOP
            PERFORM flow._require_name(CASE WHEN cardinality(keys) = 1 THEN 'key' ELSE format('keys[%s]', i) END, keys[i]);
            IF keys[i] = 'root' THEN
                -- (the root's key, though not in _commands_run_key: spawning it is
                -- spawning a declaration other than the root's)
                RAISE EXCEPTION 'flow: child key root is the run''s root command' USING ERRCODE = 'FL016';
            END IF;
            PERFORM flow._require_payload(CASE WHEN cardinality(keys) = 1 THEN 'args' ELSE format('args_array[%s]', i) END,
                                          args_list[i]);
            -- (each check called only when it has something to check: a call is
            -- a statement of its own, a few microseconds each, per spawn)
            IF p.def_args_type IS NOT NULL THEN
                PERFORM flow._require_args_fit(_spawn_many.name, p.def_owner, p.def_args_type, args_list[i]);
            END IF;
        END LOOP;
        IF group_key IS NOT NULL OR group_keys IS NOT NULL THEN
            PERFORM flow._require_group_keys(group_key, group_keys, cardinality(keys), 'keys');
        END IF;
        IF within IS NOT NULL THEN
            PERFORM flow._require_span('within', within);
        END IF;
        FOREACH spec IN ARRAY waits LOOP
            PERFORM flow._require_name('wait name', spec.name);
            IF spec.key IS NULL THEN
                RAISE EXCEPTION 'flow: wait key must not be NULL' USING ERRCODE = 'FL002';
            END IF;
            PERFORM flow._require_short('wait key', spec.key);
        END LOOP;
    EXCEPTION WHEN SQLSTATE 'FL001' OR SQLSTATE 'FL002' OR SQLSTATE 'FL003' OR SQLSTATE 'FL004'
                  OR SQLSTATE 'FL005' OR SQLSTATE 'FL006' OR SQLSTATE 'FL011' OR SQLSTATE 'FL016'
                  OR SQLSTATE 'FL018' OR SQLSTATE 'FL019' THEN
        PERFORM flow._decide('invalid_decision', 'invalid_decision', SQLERRM, NULL);
        RAISE;
    END;
    IF cardinality(keys) = 0 THEN
        RETURN '{}';
    END IF;
    -- (what each child declares besides its args: see flow._declaration)
    SELECT CASE WHEN cardinality(waits) = 0 THEN '[]'::jsonb ELSE
               (SELECT coalesce(jsonb_agg(DISTINCT jsonb_build_object('name', w.name, 'key', w.key)), '[]')
                FROM unnest(waits) w) END,
           -- (a priority is declared when it is not 0: children spawned before
           -- there were priorities declared none, and a re-spawn still matches)
           CASE WHEN priority <> 0 THEN jsonb_build_object('priority', priority) ELSE '{}' END,
           group_key IS NOT NULL OR coalesce(cardinality(array_remove(group_keys, NULL)) > 0, false)
    INTO declared_waits, declared_more, grouped;
    IF priority <> 0 OR grouped THEN
        PERFORM flow._note_priority(p.lane, priority, grouped);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM flow._runs r WHERE r.id = parent.run_id) THEN
        -- The run's first child: the run gets its row (see flow._runs), under
        -- its root's lock, which the root's own chunk holds already (an
        -- external worker's spawn takes it: a cancel holds it before it
        -- gives a run its row, so neither waits for the other's insert).
        PERFORM 1 FROM flow._commands c WHERE c.id = parent.run_id FOR UPDATE;
        PERFORM flow._run_row_needed(parent.run_id);
    END IF;
    -- (tells an in-database worker's settlement that this transaction has
    -- children: see flow._settle_batch's `alone`)
    PERFORM flow._note_spawn();
    -- (most spawns are of one child: its id is made without a query, 15 µs)
    IF cardinality(keys) = 1 THEN
        children := ARRAY[flow._new_id()];
    ELSE
        children := ARRAY(SELECT flow._new_id() FROM generate_series(1, cardinality(keys)));
    END IF;
    INSERT INTO flow._commands (id, run_id, parent_id, key, name, version, queue, args, declaration, status,
        next_run_at, not_before, budget_started_at, deadline, external, owner, priority, group_key, group_hash)
    SELECT t.id, parent.run_id, parent.id, t.key, _spawn_many.name, p.def_version, p.lane, t.args,
        flow._declaration(_spawn_many.name, p.def_version, t.args, p.lane, start_after, within, declared_waits,
                          declared_more, coalesce(t.group_key, _spawn_many.group_key)),
        CASE WHEN cardinality(waits) > 0 THEN 'waiting' ELSE 'pending' END::flow.command_status,
        -- a wait ends at `within`, and at the run's deadline at the latest
        CASE WHEN cardinality(waits) = 0 THEN p.due
             ELSE least(CASE WHEN within IS NULL THEN 'infinity' ELSE greatest(now() + within, p.due) END,
                        coalesce(parent.deadline, 'infinity')) END,
        p.due, p.due, parent.deadline, p.def_external, parent.owner, priority,
        coalesce(t.group_key, _spawn_many.group_key), flow._group_hash(coalesce(t.group_key, _spawn_many.group_key))
    -- (in the order given: of a key given twice, the first is inserted; a
    -- NULL group_keys gives each child NULL there, and group_key its group)
    FROM unnest(children, keys, args_list, group_keys) AS t(id, key, args, group_key)
    ON CONFLICT (run_id, key) WHERE id <> run_id DO NOTHING;          -- index _commands_run_key
    GET DIAGNOSTICS added = ROW_COUNT;
    IF added < cardinality(keys) THEN
        -- Keys are unique within a run: the same declaration again is a no-op
        -- (a retried attempt re-spawns safely), another one is an invalid
        -- decision. A key not inserted has a command of another id.
        SELECT format('flow: child key %s was already spawned with another declaration', t.key)
        INTO conflict
        FROM unnest(children, keys, args_list, group_keys) WITH ORDINALITY AS t(id, key, args, group_key, n)
        JOIN flow._commands_of(parent.run_id) c ON c.key = t.key
        WHERE c.id <> t.id
          AND c.declaration IS DISTINCT FROM flow._declaration(_spawn_many.name, p.def_version, t.args, p.lane,
                                                               start_after, within, declared_waits, declared_more,
                                                               coalesce(t.group_key, _spawn_many.group_key))
        ORDER BY t.n LIMIT 1;
        IF conflict IS NOT NULL THEN
            PERFORM flow._decide('invalid_decision', 'invalid_decision', conflict, NULL);
            RAISE EXCEPTION USING MESSAGE = conflict, ERRCODE = 'FL016';
        END IF;
        -- each key's command, and of those the new ones
        SELECT array_agg(c.id ORDER BY t.n), coalesce(array_agg(c.id) FILTER (WHERE c.id = t.id), '{}')
        INTO children, inserted
        FROM unnest(children, keys) WITH ORDINALITY AS t(id, key, n)
        JOIN flow._commands_of(parent.run_id) c ON c.key = t.key;
    END IF;

    -- (a child without waits is pending already: a fan-out's spawns skip
    -- the three statements below, a sixth of a spawn's time)
    IF cardinality(waits) > 0 THEN
        FOREACH child IN ARRAY coalesce(inserted, children) LOOP
            FOR spec IN SELECT DISTINCT w.name, w.key FROM unnest(waits) w ORDER BY 1, 2 LOOP
                PERFORM flow._lock_event_waits(spec.name, spec.key, parent.owner::oid);
                -- An event emitted before the wait existed satisfies it from the journal.
                SELECT max(e.position) INTO journaled FROM flow._events e      -- index _events_name_key
                WHERE e.name = spec.name AND e.key = spec.key AND flow._may_satisfy(e.owner, e.run_id, child);
                INSERT INTO flow._waits (command_id, name, key, event_position, satisfied_at)
                VALUES (child, spec.name, spec.key, journaled, CASE WHEN journaled IS NOT NULL THEN now() END);
            END LOOP;
            PERFORM flow._promote_if_satisfied(child);
        END LOOP;
    END IF;
    PERFORM flow._wake_due_from(now());   -- (due at p.due, or when promoted: both now() or later)
    RETURN children;
END $$;

-- A run's commands, parent links, waits and events as Graphviz DOT or Mermaid.
CREATE FUNCTION flow._run_graph(caller oid, run_id uuid, format text) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r flow._runs;
    dot boolean := lower(coalesce(format, 'dot')) = 'dot';
    lines text[] := '{}';
    item record;
BEGIN
    IF lower(coalesce(format, 'dot')) NOT IN ('dot', 'mermaid') THEN
        RAISE EXCEPTION 'flow: run_graph format must be dot or mermaid, got %', format USING ERRCODE = 'FL003';
    END IF;
    SELECT * INTO r FROM flow._run_rows x WHERE x.id = run_id;
    PERFORM flow._require_member(caller, r.owner, 'run', run_id);
    -- commands
    FOR item IN
        SELECT 'c' || replace(c.id::text, '-', '') AS node, c.parent_id,
               translate(format('%s: %s v%s\n%s%s', c.key, c.name, c.version, c.status,
                   CASE WHEN c.attempts > 1 THEN format(' after %s attempts', c.attempts) ELSE '' END),
                   '"[]{}<>|', '''()()()/') AS label,
               CASE c.status WHEN 'succeeded' THEN 'palegreen' WHEN 'failed' THEN 'salmon'
                             WHEN 'running' THEN 'lightblue' WHEN 'waiting' THEN 'khaki'
                             WHEN 'cancelled' THEN 'lightgrey' ELSE 'white' END AS colour
        FROM flow._commands_of(_run_graph.run_id) c ORDER BY c.created_at, c.id
    LOOP
        lines := lines || CASE WHEN dot
            THEN format('  %s [label="%s", fillcolor=%s];', item.node, item.label, item.colour)
            ELSE format('  %s["%s"]', item.node, replace(item.label, '\n', '<br/>')) END;
        IF item.parent_id IS NOT NULL THEN
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s;' ELSE '  %s --> %s' END,
                                     'c' || replace(item.parent_id::text, '-', ''), item.node);
        END IF;
    END LOOP;
    -- events emitted by this run's commands or satisfying its waits, and open waits
    FOR item IN
        SELECT DISTINCT 'e' || e.position AS node, e.command_id,
               translate(format('event %s/%s', e.name, e.key), '"[]{}<>|', '''()()()/') AS label
        FROM flow._events e
        WHERE e.run_id = _run_graph.run_id
           OR e.position IN (SELECT w.event_position
                             FROM flow._waits w JOIN flow._commands_of(_run_graph.run_id) c ON c.id = w.command_id)
    LOOP
        lines := lines || CASE WHEN dot THEN format('  %s [shape=ellipse, label="%s"];', item.node, item.label)
                               ELSE format('  %s(["%s"])', item.node, item.label) END;
        IF item.command_id IS NOT NULL AND EXISTS (SELECT 1 FROM flow._commands c WHERE c.id = item.command_id
                                                   AND c.run_id = _run_graph.run_id) THEN
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s [label="emits"];' ELSE '  %s -- emits --> %s' END,
                                     'c' || replace(item.command_id::text, '-', ''), item.node);
        END IF;
    END LOOP;
    FOR item IN
        SELECT w.event_position, 'c' || replace(w.command_id::text, '-', '') AS waiter,
               'w' || md5(w.command_id::text || w.name || w.key) AS open_node,
               translate(format('waiting for %s/%s', w.name, w.key), '"[]{}<>|', '''()()()/') AS label
        FROM flow._waits w JOIN flow._commands_of(_run_graph.run_id) c ON c.id = w.command_id
        ORDER BY w.name, w.key
    LOOP
        IF item.event_position IS NOT NULL THEN
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s [style=dashed, label="satisfies"];'
                                          ELSE '  %s -. satisfies .-> %s' END, 'e' || item.event_position, item.waiter);
        ELSE
            lines := lines || CASE WHEN dot
                THEN format('  %s [shape=ellipse, style=dashed, label="%s"];', item.open_node, item.label)
                ELSE format('  %s(["%s"])', item.open_node, item.label) END;
            lines := lines || format(CASE WHEN dot THEN '  %s -> %s [style=dashed];' ELSE '  %s -.-> %s' END,
                                     item.open_node, item.waiter);
        END IF;
    END LOOP;
    IF dot THEN
        RETURN format(E'digraph "run %s" {\n  rankdir=LR;\n  label="run %s: %s";\n  node [shape=box, style="rounded,filled", fontname="Helvetica"];\n%s\n}\n',
                      r.id, r.id, r.status, array_to_string(lines, E'\n'));
    END IF;
    RETURN format(E'flowchart LR\n%s\n', array_to_string(lines, E'\n'));
END $$;
