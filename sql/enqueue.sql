-- Enqueue: starting runs (one, or many in one statement).

-- Resolve a definition: newest version unless one is named.
CREATE FUNCTION flow._definition(name text, version integer) RETURNS flow._definitions
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    d flow._definitions;
BEGIN
    PERFORM flow._require_name('name', name);
    SELECT * INTO d FROM flow._definitions x
    WHERE x.name = _definition.name AND (_definition.version IS NULL OR x.version = _definition.version)
    ORDER BY x.version DESC LIMIT 1;
    IF NOT FOUND THEN
        IF version IS NULL THEN
            RAISE EXCEPTION 'flow: no definition named %', name USING ERRCODE = 'FL001';
        END IF;
        RAISE EXCEPTION 'flow: definition % has no version %', name, version USING ERRCODE = 'FL001';
    END IF;
    RETURN d;
END $$;

-- Who may start commands of a definition: its owner's members, and the
-- roles its owner opened it to (flow.grant_definition). To anyone else it does
-- not exist: the same FL001 as an unknown name, so names cannot be probed.
CREATE FUNCTION flow._require_use(caller oid, d flow._definitions) RETURNS void
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT (pg_has_role(caller, d.owner, 'MEMBER')
            OR EXISTS (SELECT 1 FROM flow._definition_names n
                       WHERE n.name = d.name AND flow._among(caller, n.starters))) THEN
        RAISE EXCEPTION 'flow: no definition named %', d.name USING ERRCODE = 'FL001';
    END IF;
END $$;

-- When a new command is first due, from start_after or run_at.
CREATE FUNCTION flow._first_due(start_after interval, run_at timestamptz) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF start_after IS NOT NULL AND run_at IS NOT NULL THEN
        RAISE EXCEPTION 'flow: give start_after or run_at, not both' USING ERRCODE = 'FL006';
    END IF;
    PERFORM flow._require_span('start_after', start_after, zero_ok => true);
    IF NOT isfinite(run_at) OR run_at > now() + interval '100 years' THEN
        RAISE EXCEPTION 'flow: run_at must be a finite time within 100 years, got %', run_at USING ERRCODE = 'FL005';
    END IF;
    RETURN greatest(now(), coalesce(run_at, now() + coalesce(start_after, interval '0')));
END $$;

CREATE FUNCTION flow._deadline(deadline interval) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF deadline <= interval '0' THEN
        RAISE EXCEPTION 'flow: deadline % is already past', deadline USING ERRCODE = 'FL007';
    END IF;
    PERFORM flow._require_span('deadline', deadline);
    RETURN now() + deadline;
END $$;

-- What enqueue and enqueue_many share: resolve and check the definition, the
-- queue and the schedule.
CREATE FUNCTION flow._plan_enqueue(caller oid, name text, version integer, queue text, start_after interval,
    run_at timestamptz, deadline interval,
    OUT d flow._definitions, OUT lane text, OUT due timestamptz, OUT ends timestamptz)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    d := flow._definition(name, version);
    PERFORM flow._require_use(caller, d);
    due := flow._first_due(start_after, run_at);
    ends := flow._deadline(deadline);
    -- the definition's own queue was its owner's choice; another one must be the caller's to use
    lane := CASE WHEN queue IS NULL THEN d.queue ELSE flow._use_queue(caller, queue) END;
    IF ends IS NOT NULL AND ends <= due THEN
        RAISE EXCEPTION 'flow: deadline % passes before the run is due at %', ends, due USING ERRCODE = 'FL007';
    END IF;
END $$;

-- The root commands of new runs (run_ids[i] gets args[i]), and the wake-up.
CREATE FUNCTION flow._insert_roots(d flow._definitions, lane text, due timestamptz, ends timestamptz,
    run_ids uuid[], args jsonb[])
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO flow._commands (id, run_id, key, name, version, queue, args, declaration, status,
        next_run_at, not_before, budget_started_at, deadline, external)
    -- (a root is never spawned again, so it has no declaration to match:
    -- its args are not stored twice; its id is its run's, see _commands_run_key)
    SELECT t.run_id, t.run_id, 'root', d.name, d.version, lane, t.args, '{}',
        'pending', due, due, due, ends, d.handler IS NULL
    FROM unnest(run_ids, args) AS t(run_id, args);
    PERFORM flow._wake();
END $$;

CREATE FUNCTION flow._enqueue(caller oid, name text, args jsonb, key text, version integer, queue text,
    start_after interval, run_at timestamptz, deadline interval)
RETURNS uuid
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
-- (the ON CONFLICT below names columns key and owner, which cannot be qualified)
DECLARE
    p record := flow._plan_enqueue(caller, name, version, queue, start_after, run_at, deadline);
    run_id uuid := flow._new_id();
    existing flow._runs;
BEGIN
    PERFORM flow._require_payload('args', args);
    PERFORM flow._require_args_fit(p.d, args);
    PERFORM flow._require_short('key', key);
    IF key IS NOT NULL AND btrim(key) = '' THEN
        RAISE EXCEPTION 'flow: key must not be empty (NULL for none)' USING ERRCODE = 'FL002';
    END IF;
    -- The run key makes enqueue idempotent: a concurrent insert of the same key
    -- waits for the first to commit, then finds its row.
    INSERT INTO flow._runs (id, key, owner, name, version, queue, args, deadline)
    VALUES (run_id, key, caller, (p.d).name, (p.d).version, p.lane, args, p.ends)
    ON CONFLICT (owner, key) WHERE key IS NOT NULL DO NOTHING;      -- index _runs_owner_key
    IF NOT FOUND THEN
        SELECT * INTO existing FROM flow._runs r WHERE r.owner = caller AND r.key = _enqueue.key;
        IF existing.name IS DISTINCT FROM (p.d).name OR existing.version IS DISTINCT FROM (p.d).version
           OR existing.args IS DISTINCT FROM args OR existing.queue IS DISTINCT FROM p.lane THEN
            RAISE EXCEPTION 'flow: run key % was already used for another declaration', key
                USING ERRCODE = 'FL010',
                      DETAIL = format('existing run %s is %s v%s on queue %s', existing.id, existing.name,
                                      existing.version, existing.queue);
        END IF;
        RETURN existing.id;
    END IF;
    PERFORM flow._insert_roots(p.d, p.lane, p.due, p.ends, ARRAY[run_id], ARRAY[args]);
    RETURN run_id;
END $$;

-- Many runs in one statement: set-based, no run keys.
CREATE FUNCTION flow._enqueue_many(caller oid, name text, args_array jsonb[], version integer, queue text,
    start_after interval, run_at timestamptz, deadline interval)
RETURNS uuid[]
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p record := flow._plan_enqueue(caller, name, version, queue, start_after, run_at, deadline);
    limit_bytes integer := flow._max_payload_bytes();
    bad record;
    ids uuid[];
BEGIN
    IF args_array IS NULL THEN
        RAISE EXCEPTION 'flow: args_array must not be NULL' USING ERRCODE = 'FL003';
    END IF;
    SELECT i, a INTO bad FROM unnest(args_array) WITH ORDINALITY AS t(a, i)
    WHERE a IS NULL OR jsonb_typeof(a) <> 'object' OR octet_length(a::text) > limit_bytes
    LIMIT 1;
    IF FOUND THEN
        IF bad.a IS NULL OR jsonb_typeof(bad.a) <> 'object' THEN
            RAISE EXCEPTION 'flow: args_array[%] must be a JSON object', bad.i USING ERRCODE = 'FL003';
        END IF;
        RAISE EXCEPTION 'flow: args_array[%] is over flow.max_result_bytes (% bytes)', bad.i, limit_bytes
            USING ERRCODE = 'FL004';
    END IF;
    IF (p.d).args_type IS NOT NULL THEN
        SELECT t.i, t.why INTO bad FROM (
            SELECT i, flow._args_misfit_as((p.d).owner, (p.d).args_type, a::text) AS why
            FROM unnest(args_array) WITH ORDINALITY AS u(a, i)) t
        WHERE t.why IS NOT NULL
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'flow: args_array[%] does not fit %: %', bad.i, (p.d).args_type, bad.why
                USING ERRCODE = 'FL019';
        END IF;
    END IF;
    SELECT coalesce(array_agg(flow._new_id()), '{}') INTO ids FROM unnest(args_array);
    INSERT INTO flow._runs (id, owner, name, version, queue, args, deadline)
    SELECT t.id, caller, (p.d).name, (p.d).version, p.lane, t.args, p.ends
    FROM unnest(ids, args_array) AS t(id, args);
    PERFORM flow._insert_roots(p.d, p.lane, p.due, p.ends, ids, args_array);
    RETURN ids;
END $$;
