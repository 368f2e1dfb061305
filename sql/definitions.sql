-- Definitions and queues: define, grants, queue settings and ownership.

-- Durations flow keeps or adds to timestamps: no field negative (a month, a
-- day and a microsecond are not comparable, so mixed signs have no meaning:
-- '4000000 mons -119999999 days' compares as one day and overflows any
-- timestamp it is added to), some field positive (or all zero where
-- zero_ok), and at most 100 years as PostgreSQL compares intervals (a month
-- as 30 days), so every field is bounded too (flow._span_ok,
-- src/spans.rs). No timestamp arithmetic in the claim, the settlement or
-- recovery can then overflow on one command's account; the tables' CHECKs
-- hold it for every row (sql/schema.sql).
CREATE FUNCTION flow._require_span(what text, value interval, zero_ok boolean DEFAULT false,
    code text DEFAULT 'FL005')
RETURNS interval
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF NOT flow._span_ok(value, zero_ok) THEN
        RAISE EXCEPTION 'flow: % must be %positive, with no negative field, and at most 100 years, got %',
            what, CASE WHEN zero_ok THEN 'zero or ' ELSE '' END, value USING ERRCODE = code;
    END IF;
    RETURN value;
END $$;

-- The search_path a role's own session would start with in this database:
-- its setting for this database (ALTER ROLE ... IN DATABASE ... SET), its
-- own (ALTER ROLE ... SET), the database's (ALTER DATABASE ... SET), in that
-- order; NULL when none sets one. The gateway gives it to the role's
-- handlers and args checks ("$user" alone for NULL: src/gateway.rs).
CREATE FUNCTION flow._search_path_of(role oid) RETURNS text
-- (plpgsql, not sql: its plan is kept per session; an sql function with a
-- SET clause is parsed and planned again at every call, 0.25 ms a chunk)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT substr(c.setting, length('search_path=') + 1)
            FROM pg_db_role_setting s CROSS JOIN LATERAL unnest(s.setconfig) AS c(setting)
            WHERE s.setrole IN (0, _search_path_of.role)
              AND s.setdatabase IN (0, (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()))
              AND (s.setrole <> 0 OR s.setdatabase <> 0)
              AND c.setting LIKE 'search\_path=%'
            ORDER BY s.setrole <> 0 DESC, s.setdatabase <> 0 DESC
            LIMIT 1);
END $$;

-- A role named in a grant: 'PUBLIC' (any case) or an existing role.
CREATE FUNCTION flow._grantee(role text) RETURNS regrole
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found regrole;
BEGIN
    PERFORM flow._require_name('role', role);
    IF lower(role) = 'public' THEN
        RETURN '-'::regrole;                 -- OID 0: everyone
    END IF;
    SELECT r.oid::regrole INTO found FROM pg_roles r WHERE r.rolname = role;   -- exact name, no quoting
    IF found IS NULL THEN
        RAISE EXCEPTION 'flow: no role named %', role USING ERRCODE = '42704';
    END IF;
    RETURN found;
END $$;

-- Whether `caller` is one of `roles` or a member of one ('-' is PUBLIC).
-- (Executable by everyone: the flow.queues view calls it as its reader.)
CREATE FUNCTION flow._among(caller oid, roles regrole[]) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM unnest(roles) g WHERE g::oid = 0::oid OR pg_has_role(caller, g, 'MEMBER'))
$$;

-- A grant list with `grantee` added (allow) or removed.
CREATE FUNCTION flow._granted(roles regrole[], grantee regrole, allow boolean) RETURNS regrole[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN allow THEN (SELECT array_agg(DISTINCT g) FROM unnest(roles || grantee) g)
                ELSE array_remove(roles, grantee) END
$$;

-- A queue row, created on first use: owned by its creator, except 'default',
-- which belongs to no role (superusers manage it) and is open to everyone.
CREATE FUNCTION flow._queue(caller oid, name text, for_update boolean DEFAULT false) RETURNS flow._queues
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues;
BEGIN
    PERFORM flow._require_name('queue', name);
    SELECT * INTO q FROM flow._queues x WHERE x.name = _queue.name;
    IF NOT FOUND AND name LIKE 'role:%' AND name <> flow._own_queue(caller)
       AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller) THEN
        RAISE EXCEPTION 'flow: queue % is another role''s own queue (names starting with "role:" are reserved)', name
            USING ERRCODE = 'FL011', HINT = 'Name no queue to use your own, or choose another name.';
    END IF;
    IF NOT FOUND AND name <> 'default' AND NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller)
       AND (SELECT count(*) FROM flow._queues x WHERE x.owner = caller)
           >= current_setting('flow.max_queues_per_role')::integer THEN
        -- every queue costs each claim a probe: one role cannot slow everyone's
        RAISE EXCEPTION 'flow: role % owns flow.max_queues_per_role (%) queues already', caller::regrole,
            current_setting('flow.max_queues_per_role') USING ERRCODE = 'FL018';
    END IF;
    IF NOT FOUND OR for_update THEN
        INSERT INTO flow._queues (name, owner, users)
        VALUES (name, CASE WHEN name = 'default' THEN NULL ELSE caller END,
                CASE WHEN name = 'default' THEN '{-}' ELSE '{}' END::regrole[])
        ON CONFLICT DO NOTHING;
        IF FOUND AND name <> 'default' THEN
            PERFORM flow._mark_owner(caller);
        END IF;
        IF for_update THEN
            SELECT * INTO q FROM flow._queues x WHERE x.name = _queue.name FOR NO KEY UPDATE;
        ELSE
            SELECT * INTO q FROM flow._queues x WHERE x.name = _queue.name;
        END IF;
    END IF;
    RETURN q;
END $$;

-- Where a role's definitions go when they name no queue: its own queue,
-- 'role:<name>' (superusers: 'default'). Roles never share a lane unless
-- they choose to, so one role's backlog cannot hold up another's: queues are
-- served round-robin, while one queue runs in due order whoever enqueued.
CREATE FUNCTION flow._own_queue(caller oid) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.rolsuper THEN 'default' ELSE 'role:' || r.rolname END FROM pg_roles r WHERE r.oid = caller
$$;

-- Hold a queue a definition or a command is being put in until the
-- transaction ends: flow.drop_queue waits for the transactions that hold it
-- to commit before it looks for what uses the queue, and one that comes
-- after a drop sees the queue gone (a command or definition put in a
-- dropped queue would never run: claims read the queues there are). Raises
-- 40001 (try again) when the queue was dropped meanwhile: a definition
-- moved to another queue, whose old one was dropped while this enqueue had
-- read it, runs in its new queue at the next try. Returns the queue's name.
-- (No SET clause, as flow._plan_enqueue, which calls it for every enqueue and
-- spawn: its callers pin search_path; a SET costs each call a walk of every
-- setting when it ends.)
CREATE FUNCTION flow._hold_queue(name text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM flow._lock_queue_name(_hold_queue.name, false);
    -- (after the lock: a statement of its own, whose snapshot sees a drop
    -- that committed before; a transaction that keeps its snapshot reads the
    -- row as it now is by locking it, and gets 40001 if it was deleted since)
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM flow._queues x WHERE x.name = _hold_queue.name;
    ELSE
        PERFORM 1 FROM flow._queues x WHERE x.name = _hold_queue.name FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'flow: queue % was dropped meanwhile', _hold_queue.name USING ERRCODE = '40001',
            HINT = 'Try again.';
    END IF;
    RETURN _hold_queue.name;
END $$;

-- Who may put commands in a queue: its owner's members and the roles it was
-- granted to (flow._use_queue; a re-drive, flow._retry).
CREATE FUNCTION flow._may_use_queue(caller oid, q flow._queues) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(pg_has_role(caller, q.owner, 'MEMBER'), false) OR flow._among(caller, q.users)
$$;

-- Put commands in a queue: its owner's members and the roles it was granted to.
CREATE FUNCTION flow._use_queue(caller oid, name text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues := flow._queue(caller, name);
BEGIN
    IF NOT flow._may_use_queue(caller, q) THEN
        RAISE EXCEPTION 'flow: queue % belongs to another role', name USING ERRCODE = 'FL011',
            HINT = 'Use a queue of your own, or ask its owner for flow.grant_queue().';
    END IF;
    RETURN flow._hold_queue(q.name);
END $$;

-- Manage a queue (limit, pause, grants): its owner's members; 'default': superusers.
CREATE FUNCTION flow._manage_queue(caller oid, name text) RETURNS flow._queues
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues := flow._queue(caller, name, for_update => true);
    allowed boolean := CASE WHEN q.owner IS NULL THEN (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = caller)
                            ELSE pg_has_role(caller, q.owner, 'MEMBER') END;
BEGIN
    IF NOT allowed THEN
        RAISE EXCEPTION 'flow: queue % belongs to another role', name USING ERRCODE = 'FL011';
    END IF;
    RETURN q;
END $$;

-- Why args do not fit an args_type (NULL: they fit). A composite type takes
-- a JSON object whose keys are its attributes and whose values convert
-- (jsonb_populate_record); a domain over jsonb takes what its checks allow.
-- Called only through the gateway (src/gateway.rs, check_args), as the
-- definition's owner: its own statements run under the pinned path, the
-- owner's code (the domain's checks, the columns' types) under `path`, the
-- owner's own search_path. (Executable by PUBLIC: it runs as its caller.)
CREATE FUNCTION flow._args_misfit(args_type regtype, args jsonb, path text) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t pg_type;
    unknown text;
    -- (the type's name as the pinned path prints it: qualified wherever it
    -- is not in pg_catalog, so the owner's path cannot change what it names)
    cast_sql text;
BEGIN
    SELECT * INTO t FROM pg_type WHERE oid = args_type;
    IF t.typtype = 'c' THEN
        SELECT k INTO unknown FROM jsonb_object_keys(args) k
        WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = t.typrelid AND a.attname = k
                          AND a.attnum > 0 AND NOT a.attisdropped)
        LIMIT 1;
        IF FOUND THEN
            RETURN format('%s has no attribute %s', args_type, unknown);
        END IF;
        cast_sql := format('SELECT pg_catalog.jsonb_populate_record(NULL::%s, $1)', args_type);
    ELSE
        cast_sql := format('SELECT $1::%s', args_type);
    END IF;
    PERFORM set_config('search_path', coalesce(path, '"$user"'), true);
    EXECUTE cast_sql USING args;
    RETURN NULL;
EXCEPTION WHEN data_exception OR integrity_constraint_violation OR check_violation THEN
    RETURN SQLERRM;
END $$;

CREATE FUNCTION flow._require_args_fit(name text, owner oid, args_type regtype, args jsonb) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    misfit text := CASE WHEN args_type IS NOT NULL THEN flow._args_misfit_as(owner, args_type, args::text) END;
BEGIN
    IF misfit IS NOT NULL THEN
        RAISE EXCEPTION 'flow: args do not fit % of definition %: %', args_type, name, misfit
            USING ERRCODE = 'FL019';
    END IF;
END $$;

CREATE FUNCTION flow._define(caller oid, name text, handler regprocedure, version integer, queue text,
    max_attempts integer, backoff interval, backoff_max interval, max_elapsed interval, timeout interval,
    args_type regtype, priority integer)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    fn record;
    takes_context boolean := false;
    named flow._definition_names;
BEGIN
    PERFORM flow._require_name('name', name);
    queue := flow._require_name('queue', coalesce(queue, flow._own_queue(caller)));
    IF version IS NULL OR version < 1 THEN
        RAISE EXCEPTION 'flow: version must be 1 or more, got %', version USING ERRCODE = 'FL015';
    END IF;
    IF max_attempts IS NULL OR max_attempts < 1 THEN
        RAISE EXCEPTION 'flow: max_attempts must be 1 or more, got %', max_attempts USING ERRCODE = 'FL015';
    END IF;
    IF backoff IS NULL OR backoff_max IS NULL OR backoff_max < backoff THEN
        RAISE EXCEPTION 'flow: backoff must be positive and at most backoff_max (got % and %)', backoff, backoff_max
            USING ERRCODE = 'FL015';
    END IF;
    PERFORM flow._require_span('backoff', backoff, code => 'FL015');
    PERFORM flow._require_span('backoff_max', backoff_max, code => 'FL015');
    PERFORM flow._require_span('max_elapsed', max_elapsed, code => 'FL015');
    PERFORM flow._require_span('timeout', timeout, code => 'FL015');
    IF args_type IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM pg_type t WHERE t.oid = args_type
          AND (t.typtype = 'c' OR (t.typtype = 'd' AND t.typbasetype = 'pg_catalog.jsonb'::regtype))) THEN
        RAISE EXCEPTION 'flow: args_type % must be a composite type or a domain over jsonb', args_type
            USING ERRCODE = 'FL015';
    END IF;
    IF args_type IS NOT NULL AND NOT has_type_privilege(caller, args_type, 'USAGE') THEN
        RAISE EXCEPTION 'flow: role % may not use type %', caller::regrole, args_type USING ERRCODE = '42501';
    END IF;
    IF handler IS NOT NULL THEN
        SELECT p.pronargs, p.proargtypes, p.prorettype, p.prokind, p.proretset,
               n.nspname ~ '^pg_(toast_)?temp_' AS temporary INTO fn
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE p.oid = handler;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'flow: handler % does not exist', handler USING ERRCODE = '42883';
        END IF;
        IF fn.prokind <> 'f' OR fn.proretset
           OR fn.prorettype NOT IN ('pg_catalog.jsonb'::regtype, 'pg_catalog.void'::regtype)
           OR fn.pronargs NOT IN (1, 2)
           OR fn.proargtypes[0] <> 'pg_catalog.jsonb'::regtype
           OR (fn.pronargs = 2 AND fn.proargtypes[1] <> 'flow.context'::regtype) THEN
            RAISE EXCEPTION 'flow: handler % has the wrong signature', handler::text
                USING ERRCODE = 'FL008',
                      HINT = 'A handler is a function (args jsonb) or (args jsonb, ctx flow.context) returning jsonb or void.';
        END IF;
        IF fn.temporary THEN
            RAISE EXCEPTION 'flow: handler % is a temporary function; it ends with its session', handler::text
                USING ERRCODE = 'FL008';
        END IF;
        takes_context := fn.pronargs = 2;
        IF NOT has_function_privilege(caller, handler, 'EXECUTE') THEN
            RAISE EXCEPTION 'flow: role % may not execute handler %', caller::regrole, handler::text
                USING ERRCODE = '42501';
        END IF;
    END IF;

    -- The name belongs to its first definer. Its row is locked before anything
    -- else is checked, so a concurrent define of the same name waits here and
    -- then sees who owns it: no role can slip its handler under another's name.
    INSERT INTO flow._definition_names AS n (name, owner) VALUES (name, caller) ON CONFLICT DO NOTHING;
    SELECT * INTO named FROM flow._definition_names n WHERE n.name = _define.name FOR UPDATE;
    IF NOT pg_has_role(caller, named.owner, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: the definition name % is taken by another role', name USING ERRCODE = 'FL011';
    END IF;
    PERFORM flow._mark_owner(named.owner);
    IF cardinality(named.starters) > 0 AND handler = 'flow.run_sql(pg_catalog.jsonb)'::regprocedure THEN
        RAISE EXCEPTION 'flow: definition % is open to other roles; it cannot run flow.run_sql', name
            USING ERRCODE = '42501';
    END IF;
    PERFORM flow._use_queue(caller, queue);
    IF priority IS NULL THEN
        RAISE EXCEPTION 'flow: priority must not be NULL (0 is the default)' USING ERRCODE = '22004';
    END IF;
    PERFORM flow._priority(priority, 0::smallint);
    INSERT INTO flow._definitions AS d (name, version, handler, takes_context, owner, queue,
        max_attempts, backoff, backoff_max, max_elapsed, timeout, args_type, priority)
    VALUES (name, version, handler, takes_context, named.owner, queue,
        max_attempts, backoff, backoff_max, max_elapsed, timeout, args_type, priority)
    ON CONFLICT ON CONSTRAINT _definitions_pkey DO UPDATE SET
        handler = excluded.handler, takes_context = excluded.takes_context, queue = excluded.queue,
        max_attempts = excluded.max_attempts, backoff = excluded.backoff,
        backoff_max = excluded.backoff_max, max_elapsed = excluded.max_elapsed,
        timeout = excluded.timeout, args_type = excluded.args_type, priority = excluded.priority,
        updated_at = now();
    -- A version redefined with or without a handler changes who runs its
    -- commands still to come (rare: a scan of the unfinished commands is fine).
    UPDATE flow._commands c SET external = (handler IS NULL)
    WHERE c.name = _define.name AND c.version = _define.version
      AND c.status IN ('pending', 'waiting') AND c.external <> (handler IS NULL);
END $$;

-- Open a definition (every version) to another role, or close it again.
-- flow.run_sql definitions stay their owner's: they run any SQL as the owner.
CREATE FUNCTION flow._grant_definition(caller oid, name text, role text, allow boolean) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    named flow._definition_names;
    grantee regrole := flow._grantee(role);
BEGIN
    PERFORM flow._require_name('name', name);
    SELECT * INTO named FROM flow._definition_names n WHERE n.name = _grant_definition.name FOR UPDATE;
    IF NOT FOUND OR NOT pg_has_role(caller, named.owner, 'MEMBER') THEN
        RAISE EXCEPTION 'flow: no definition named %', name USING ERRCODE = 'FL001';
    END IF;
    IF allow AND EXISTS (SELECT 1 FROM flow._definitions d WHERE d.name = named.name
                         AND d.handler = 'flow.run_sql(pg_catalog.jsonb)'::regprocedure) THEN
        RAISE EXCEPTION 'flow: definition % runs flow.run_sql; it cannot be opened to other roles', name
            USING ERRCODE = '42501', HINT = 'Its SQL runs as its owner: let the other role define its own.';
    END IF;
    UPDATE flow._definition_names n SET starters = flow._granted(n.starters, grantee, allow)
    WHERE n.name = named.name;
END $$;

CREATE FUNCTION flow._grant_queue(caller oid, name text, role text, allow boolean) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    grantee regrole := flow._grantee(role);
    q flow._queues := flow._manage_queue(caller, name);
BEGIN
    UPDATE flow._queues x SET users = flow._granted(x.users, grantee, allow), updated_at = now()
    WHERE x.name = q.name;
END $$;

-- Set a queue's options; those the caller left out (`left_out`: see
-- flow._left_out) keep their values, and so does a NULL paused.
CREATE FUNCTION flow._set_queue(caller oid, name text, concurrency integer, paused boolean, rate integer,
    per interval, group_concurrency integer, left_out text[])
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues;
BEGIN
    IF concurrency IS NOT NULL AND concurrency < 1 THEN
        RAISE EXCEPTION 'flow: queue concurrency must be 1 or more (NULL for no limit), got %', concurrency
            USING ERRCODE = 'FL009';
    END IF;
    IF group_concurrency IS NOT NULL AND group_concurrency < 1 THEN
        RAISE EXCEPTION 'flow: queue group_concurrency must be 1 or more (NULL for no limit), got %', group_concurrency
            USING ERRCODE = 'FL009';
    END IF;
    IF rate IS NOT NULL AND rate < 0 THEN
        RAISE EXCEPTION 'flow: queue rate must be 0 or more (NULL for no limit, 0 to start none), got %', rate
            USING ERRCODE = 'FL009';
    END IF;
    IF NOT ('per' = ANY (left_out)) AND (per IS NULL OR NOT flow._span_ok(per, false)
                                         OR extract(epoch FROM per) * 1000000 < coalesce(rate, 1)) THEN
        RAISE EXCEPTION 'flow: queue rate''s per must be a positive interval of at most 100 years, and at least a microsecond per command, got %',
            coalesce(per::text, 'NULL') USING ERRCODE = 'FL009';
    END IF;
    q := flow._manage_queue(caller, name);
    UPDATE flow._queues x SET
        concurrency = CASE WHEN 'concurrency' = ANY (left_out) THEN x.concurrency ELSE _set_queue.concurrency END,
        rate = CASE WHEN 'rate' = ANY (left_out) THEN x.rate ELSE _set_queue.rate END,
        per = CASE WHEN 'per' = ANY (left_out) THEN x.per ELSE _set_queue.per END,
        group_concurrency = CASE WHEN 'group_concurrency' = ANY (left_out) THEN x.group_concurrency
                                 ELSE _set_queue.group_concurrency END,
        paused = coalesce(_set_queue.paused, x.paused),
        updated_at = now()
    WHERE x.name = q.name;
    PERFORM flow._wake();
END $$;

-- Drop a queue no definition and no unfinished command uses (its managers
-- only; false: there is no such queue). Its finished commands keep its name.
CREATE FUNCTION flow._drop_queue(caller oid, name text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q flow._queues;
BEGIN
    -- It must see what the enqueues and defines it waits for wrote (below):
    -- a transaction's own older snapshot (REPEATABLE READ, SERIALIZABLE) would
    -- not, and drop a queue a command was just put in.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'flow: drop_queue needs a READ COMMITTED transaction, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = '0A000', HINT = 'It must see what concurrent enqueues into the queue committed.';
    END IF;
    PERFORM flow._require_name('queue', name);
    IF NOT EXISTS (SELECT 1 FROM flow._queues x WHERE x.name = _drop_queue.name) THEN
        RETURN false;
    END IF;
    q := flow._manage_queue(caller, name);   -- checks the caller
    -- waits for the enqueues and defines that put something in the queue to
    -- commit (flow._hold_queue), so the checks below see what they wrote, and
    -- holds off those that come after until the queue is gone
    PERFORM flow._lock_queue_name(q.name, true);
    IF EXISTS (SELECT 1 FROM flow._definitions d WHERE d.queue = q.name)
       OR EXISTS (SELECT 1 FROM flow._commands c                      -- index _commands_due
                  WHERE flow._lane(c.queue, CASE WHEN c.external THEN c.name ELSE '' END)
                            = ANY (ARRAY(SELECT l.lane FROM flow._queue_lanes l WHERE l.queue = q.name))
                    AND c.queue = q.name AND c.status IN ('pending', 'waiting'))
       OR EXISTS (SELECT 1 FROM flow._commands c                      -- index _commands_running
                  WHERE c.queue = q.name AND c.status = 'running') THEN
        RAISE EXCEPTION 'flow: queue % is still used by definitions or unfinished commands', name
            USING ERRCODE = '2BP01';
    END IF;
    DELETE FROM flow._queues x WHERE x.name = q.name;
    -- (its priorities not yet added: a queue made again by that name starts with none)
    DELETE FROM flow._priority_notes n WHERE n.queue = q.name;
    IF q.owner IS NOT NULL AND NOT flow._owns_anything(q.owner) THEN
        PERFORM flow._unmark_owner(q.owner);
    END IF;
    RETURN true;
END $$;

-- REASSIGN OWNED BY ... TO ... moves flow's ownership too (src/roles.rs calls
-- this after PostgreSQL checked the caller may act for both roles).
CREATE FUNCTION flow._reassign_owned(old_roles oid[], new_role oid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE flow._definition_names n SET owner = new_role WHERE n.owner = ANY (old_roles);
    UPDATE flow._definitions d SET owner = new_role WHERE d.owner = ANY (old_roles);
    UPDATE flow._queues q SET owner = new_role WHERE q.owner = ANY (old_roles);
    -- (a schedule's name is its owner's: the new role may not have one of the same name)
    IF EXISTS (SELECT 1 FROM flow._schedules s JOIN flow._schedules t ON t.name = s.name
               WHERE s.owner = ANY (old_roles) AND t.owner = new_role AND NOT (t.owner = ANY (old_roles))) THEN
        RAISE EXCEPTION 'flow: role % has a schedule of the same name as one of the roles reassigned', new_role::regrole
            USING ERRCODE = '2BP01', HINT = 'Rename or unschedule one of them first.';
    END IF;
    UPDATE flow._schedules s SET owner = new_role WHERE s.owner = ANY (old_roles);
    UPDATE flow._runs r SET owner = new_role WHERE r.owner = ANY (old_roles);
    UPDATE flow._commands c SET owner = new_role WHERE c.owner = ANY (old_roles);
    -- (the journal lets an entry change its owner only so: sql/schema.sql)
    PERFORM set_config('flow_internal.reassigning', 'on', true);
    UPDATE flow._events e SET owner = new_role WHERE e.owner = ANY (old_roles);
    PERFORM set_config('flow_internal.reassigning', 'off', true);
    PERFORM flow._mark_owner(new_role);
    -- the old roles own nothing of flow here any more (see _mark_owner)
    PERFORM flow._unmark_owner(old) FROM unnest(old_roles) old;
END $$;

-- Make PostgreSQL's own dependency tracking see that `role` owns flow
-- objects in this database, so DROP ROLE run from another database (where
-- flow's hook cannot look into these tables) fails as it does for a role
-- that owns tables here: an explicit USAGE grant on schema flow (PUBLIC has
-- it anyway, so it gives nothing) is recorded in pg_shdepend. Superusers,
-- and the schema's owner, are not marked.
CREATE FUNCTION flow._mark_owner(role oid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF role IS NULL OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = role)
       OR EXISTS (SELECT 1 FROM pg_namespace n WHERE n.nspname = 'flow'
                  AND (n.nspowner = role OR EXISTS (SELECT 1 FROM aclexplode(n.nspacl) a WHERE a.grantee = role))) THEN
        RETURN;
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA flow TO %s', role::regrole);
END $$;

CREATE FUNCTION flow._unmark_owner(role oid) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_namespace n, aclexplode(n.nspacl) a WHERE n.nspname = 'flow' AND a.grantee = role) THEN
        EXECUTE format('REVOKE USAGE ON SCHEMA flow FROM %s', role::regrole);
    END IF;
END $$;

-- What keeps DROP ROLE from leaving flow objects with a dangling owner: the
-- role still owns definitions, queues, schedules or unfinished runs here.
-- (Runs are not indexed by owner, see sql/schema.sql: this reads the runs
-- table, kept small by flow.retention; DROP ROLE and flow.drop_queue are rare.)
CREATE FUNCTION flow._owns_anything(role oid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM flow._definition_names n WHERE n.owner = role)
        OR EXISTS (SELECT 1 FROM flow._queues q WHERE q.owner = role)
        OR EXISTS (SELECT 1 FROM flow._schedules s WHERE s.owner = role)
        OR EXISTS (SELECT 1 FROM flow._run_rows r WHERE r.owner = role AND r.status = 'running')
$$;
