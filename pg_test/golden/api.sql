-- flow's public SQL API as a golden file: each public function's normal call
-- and its main errors, and the views' columns. Errors show their SQLSTATE
-- alone (VERBOSITY sqlstate; flow's codes are FLnnn, see the README's errors).
-- Each case runs in BEGIN ... ROLLBACK, so no case sees another's work; and
-- nothing printed depends on time, ids or pids (ids are kept in psql
-- variables with \gset, times are compared, never shown).
-- Run by pg_test/test_golden.py with psql against a fresh cluster; its output
-- must equal api.out. (A change of the API: run the test, read the diff, and
-- copy the output it saved over api.out.)
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
\pset null '<null>'

-- ================================================================ setup (committed)
CREATE SCHEMA golden;
GRANT USAGE ON SCHEMA golden TO PUBLIC;
CREATE FUNCTION golden.echo(args jsonb) RETURNS jsonb LANGUAGE sql AS 'SELECT args';
CREATE FUNCTION golden.with_context(args jsonb, ctx flow.context) RETURNS void LANGUAGE sql AS 'SELECT';
CREATE FUNCTION golden.two_ints(a int, b int) RETURNS jsonb LANGUAGE sql AS 'SELECT NULL::jsonb';
CREATE TYPE golden.order_args AS (order_id int, sku text);
-- a run graph without what differs from run to run: ids (node names are c or w and
-- an id's 32 digits) and event positions (node e and the position)
CREATE FUNCTION golden.ids_out(graph text) RETURNS text LANGUAGE sql AS $$
    SELECT regexp_replace(regexp_replace(regexp_replace(graph,
        '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', '<id>', 'g'),
        '\m([cw])[0-9a-f]{32}\M', '\1<id>', 'g'),
        '\me[0-9]+\M', 'e<position>', 'g')
$$;
CREATE ROLE golden_alice;
CREATE ROLE golden_bob;

-- ================================================================ flow.define
-- a definition and its policy, as flow.definitions shows it
BEGIN;
SELECT flow.define('g_echo', 'golden.echo'::regproc, version => 2, queue => 'g_mail', max_attempts => 7,
                   backoff => '2 s', backoff_max => '1 min', timeout => '30 s');
SELECT name, version, handler, external, takes_context, owner, queue, max_attempts, backoff, backoff_max,
       max_elapsed, timeout, starters
FROM flow.definitions WHERE name = 'g_echo';
-- an external definition (no handler), one whose handler takes the context, one with typed args
SELECT flow.define('g_ext', NULL);
SELECT flow.define('g_ctx', 'golden.with_context'::regproc);
SELECT flow.define('g_typed', 'golden.echo'::regproc, args_type => 'golden.order_args');
SELECT name, handler, external, takes_context FROM flow.definitions WHERE name IN ('g_ext', 'g_ctx', 'g_typed')
ORDER BY name;
-- no name: FL002
SELECT flow.define(NULL, 'golden.echo'::regproc);
SELECT flow.define('', 'golden.echo'::regproc);
-- a handler of another shape: FL008
SELECT flow.define('g_bad', 'golden.two_ints'::regproc);
-- a policy out of range, an args_type that is no composite: FL015
SELECT flow.define('g_bad', 'golden.echo'::regproc, max_attempts => 0);
SELECT flow.define('g_bad', 'golden.echo'::regproc, backoff => '2 h', backoff_max => '1 h');
SELECT flow.define('g_bad', 'golden.echo'::regproc, timeout => '-1 s');
SELECT flow.define('g_bad', 'golden.echo'::regproc, args_type => 'integer');
-- no such handler: 42883 (regproc's own)
SELECT flow.define('g_bad', 'golden.nope'::regproc);
-- another role's name: FL011
SET ROLE golden_alice;
SELECT flow.define('g_alices', 'golden.echo'::regproc);
SET ROLE golden_bob;
SELECT flow.define('g_alices', 'golden.echo'::regproc, max_attempts => 1);
RESET ROLE;
SELECT count(*) AS bad_definitions FROM flow.definitions WHERE name = 'g_bad';
ROLLBACK;

-- ================================================================ flow.set_queue, flow.drop_queue
-- a limit, then paused (NULL leaves the other as it was)
BEGIN;
SELECT flow.set_queue('g_q', concurrency => 3);
SELECT flow.set_queue('g_q', paused => true);
SELECT name, owner, users, concurrency, paused, pending, due, waiting, running FROM flow.queues WHERE name = 'g_q';
-- a limit below 1: FL009; no name: FL002
SELECT flow.set_queue('g_q', concurrency => 0);
SELECT flow.set_queue(NULL);
SELECT flow.set_queue('');
-- dropped once (true), then there is none (false)
SELECT flow.drop_queue('g_q');
SELECT flow.drop_queue('g_q');
-- a queue a definition uses is kept: 2BP01
SELECT flow.define('g_on_q', NULL, queue => 'g_used');
SELECT flow.drop_queue('g_used');
ROLLBACK;

-- a rate limit, then paused: the rate stays; a negative rate or a NULL per: FL009
BEGIN;
SELECT flow.set_queue('g_rated', rate => 100, per => '1 minute');
SELECT flow.set_queue('g_rated', paused => true);
SELECT name, concurrency, paused, rate, per FROM flow.queues WHERE name = 'g_rated';
SELECT flow.set_queue('g_rated', rate => -1);
SELECT flow.set_queue('g_rated', per => NULL);
ROLLBACK;

-- ================================================================ flow.schedule, flow.unschedule, flow.pause_schedule
BEGIN;
SELECT flow.define('g_tick', 'golden.echo'::regproc);
SELECT flow.schedule('g_yearly', '0 0 1 1 *', 'g_tick', '{"a": 1}', timezone => 'Europe/Paris') > now() AS next_tick_ahead;
SELECT name, cron, timezone, definition, args, queue, paused, last_tick, owner, overlap, catch_up FROM flow.schedules;
SELECT flow.pause_schedule('g_yearly');
SELECT name, paused FROM flow.schedules;
-- a bad cron: FL022; an unknown zone: FL023; a bad catch_up: 22023; an unknown definition: FL001
SELECT flow.schedule('g_bad', '61 * * * *', 'g_tick');
SELECT flow.schedule('g_bad', '* * * * *', 'g_tick', timezone => 'Mars/Olympus');
SELECT flow.schedule('g_bad', '* * * * *', 'g_tick', catch_up => -1);
SELECT flow.schedule('g_bad', '* * * * *', 'g_none');
SELECT flow.unschedule('g_yearly');
SELECT flow.unschedule('g_yearly');
ROLLBACK;

-- ================================================================ flow.grant_queue, flow.revoke_queue
BEGIN;
SELECT flow.set_queue('g_shared');
SELECT flow.grant_queue('g_shared', 'golden_bob');
SELECT users FROM flow.queues WHERE name = 'g_shared';
SELECT flow.revoke_queue('g_shared', 'golden_bob');
SELECT users FROM flow.queues WHERE name = 'g_shared';
-- no such role: 42704
SELECT flow.grant_queue('g_shared', 'golden_nobody');
ROLLBACK;

-- ================================================================ flow.grant_definition, flow.revoke_definition
BEGIN;
SELECT flow.define('g_private', 'golden.echo'::regproc);
-- to a role it was not granted to, a definition does not exist: FL001
SET ROLE golden_bob;
SELECT flow.enqueue('g_private') IS NOT NULL AS started;
RESET ROLE;
SELECT flow.grant_definition('g_private', 'golden_bob');
SELECT starters FROM flow.definitions WHERE name = 'g_private';
SET ROLE golden_bob;
SELECT flow.enqueue('g_private') IS NOT NULL AS started;
RESET ROLE;
SELECT flow.revoke_definition('g_private', 'golden_bob');
SELECT starters FROM flow.definitions WHERE name = 'g_private';
SET ROLE golden_bob;
SELECT flow.enqueue('g_private') IS NOT NULL AS started;
RESET ROLE;
-- no such role: 42704; no such definition: FL001
SELECT flow.grant_definition('g_private', 'golden_nobody');
SELECT flow.grant_definition('g_nothing', 'golden_bob');
ROLLBACK;

-- ================================================================ flow.enqueue
-- a run and its root command; the same key gives the same run
BEGIN;
SELECT flow.define('g_ext', NULL);
SELECT flow.define('g_typed', 'golden.echo'::regproc, args_type => 'golden.order_args');
SELECT flow.enqueue('g_ext', '{"user": 42}', key => 'k1', start_after => '5 min', deadline => '1 hour') AS run \gset
SELECT flow.enqueue('g_ext', '{"user": 42}', key => 'k1') = :'run' AS same_run;
SELECT name, version, key, queue, status, args, result, error, owner, attempts,
       deadline > now() + interval '59 min' AS deadline_in_an_hour, finished_at IS NULL AS unfinished
FROM flow.runs WHERE id = :'run';
SELECT key, name, queue, status, attempts, next_run_at > now() + interval '4 min' AS in_5_min, parent_id
FROM flow.commands WHERE run_id = :'run';
-- typed args that fit
SELECT flow.enqueue('g_typed', '{"order_id": 7, "sku": "book"}') IS NOT NULL AS started;
-- no such definition (or version): FL001
SELECT flow.enqueue('g_nothing');
SELECT flow.enqueue('g_ext', version => 9);
-- no name, an empty key: FL002
SELECT flow.enqueue(NULL);
SELECT flow.enqueue('g_ext', key => '');
-- args that are no object: FL003; too large: FL004
SELECT flow.enqueue('g_ext', '[1, 2]');
SELECT flow.enqueue('g_ext', NULL);
SELECT flow.enqueue('g_ext', jsonb_build_object('big', repeat('x', 300000)));
-- a negative start_after: FL005; start_after and run_at both: FL006; a deadline before the start: FL007
SELECT flow.enqueue('g_ext', start_after => '-1 s');
SELECT flow.enqueue('g_ext', start_after => '1 min', run_at => now());
SELECT flow.enqueue('g_ext', start_after => '2 hours', deadline => '1 hour');
-- the same key with other args: FL010
SELECT flow.enqueue('g_ext', '{"user": 43}', key => 'k1');
-- args that do not fit the args_type: FL019
SELECT flow.enqueue('g_typed', '{"order_id": "seven"}');
SELECT count(*) AS runs FROM flow.runs WHERE name IN ('g_ext', 'g_typed');
ROLLBACK;

-- a priority: the definition's, or the one given; outside smallint: 22003
BEGIN;
SELECT flow.define('g_prio', 'golden.echo'::regproc, priority => 5);
SELECT priority FROM flow.definitions WHERE name = 'g_prio';
SELECT flow.enqueue('g_prio') AS p_default, flow.enqueue('g_prio', priority => -3) AS p_given \gset
SELECT priority FROM flow.commands WHERE run_id IN (:'p_default', :'p_given') ORDER BY priority;
SELECT flow.enqueue('g_prio', priority => 40000);
-- groups: one key for all, or one each; a limit per group; an empty key: FL002
SELECT flow.set_queue('g_grouped', group_concurrency => 2);
SELECT flow.enqueue_many('g_prio', ARRAY['{}'::jsonb, '{}'], queue => 'g_grouped', group_keys => ARRAY['t1', 't2']) AS g_runs \gset
SELECT group_key FROM flow.commands WHERE queue = 'g_grouped' ORDER BY group_key;
SELECT name, group_concurrency FROM flow.queues WHERE name = 'g_grouped';
SELECT flow.enqueue('g_prio', group_key => '');
ROLLBACK;

-- ================================================================ flow.enqueue_many
-- one run per element, in order
BEGIN;
SELECT flow.define('g_ext', NULL);
SELECT cardinality(flow.enqueue_many('g_ext', array['{"i": 1}', '{"i": 2}', '{"i": 3}']::jsonb[])) AS runs;
SELECT args, status FROM flow.runs WHERE name = 'g_ext' ORDER BY id;
SELECT flow.enqueue_many('g_ext', '{}'::jsonb[]) AS none;
-- an element that is no object, or no array: FL003 (and nothing is started)
SELECT flow.enqueue_many('g_ext', array['{}', '[]']::jsonb[]);
SELECT flow.enqueue_many('g_ext', array['{}', NULL]::jsonb[]);
SELECT flow.enqueue_many('g_ext', NULL);
SELECT count(*) AS runs FROM flow.runs WHERE name = 'g_ext';
ROLLBACK;

-- ================================================================ flow.cancel, flow.await
BEGIN;
SELECT flow.define('g_ext', NULL);
SELECT flow.enqueue('g_ext') AS run \gset
SELECT * FROM flow.await(:'run', '0 s');
SELECT flow.cancel(:'run') AS cancelled;
SELECT flow.cancel(:'run') AS cancelled_again;
SELECT status, result, error ->> 'stop_reason' AS stop_reason FROM flow.await(:'run', '0 s');
SELECT key, status, stop_reason FROM flow.commands WHERE run_id = :'run';
-- no such run (or another role's): FL014
SELECT flow.cancel('00000000-0000-0000-0000-000000000000');
SELECT * FROM flow.await('00000000-0000-0000-0000-000000000000', '1 s');
-- a timeout out of range: FL005
SELECT * FROM flow.await(:'run', '300000 years');
ROLLBACK;

-- ================================================================ flow.emit, flow.wait
BEGIN;
SELECT flow.emit('g_paid', 'order-1', '{"amount": 5}') > 0 AS appended;
SELECT name, key, payload, owner, run_id, command_id, satisfied_waits FROM flow.events WHERE name = 'g_paid';
SELECT flow.wait('g_paid', 'order-1');
-- no name or key: FL002; a payload too large: FL004
SELECT flow.emit(NULL, 'k');
SELECT flow.emit('g_e', NULL);
SELECT flow.emit('g_e', 'k', jsonb_build_object('big', repeat('x', 300000)));
ROLLBACK;

-- ================================================================ inside a handler only: spawn, fail, retry_after
BEGIN;
SELECT flow.define('g_ext', NULL);
-- spawn and fail(keep_writes) outside a handler: FL012
SELECT flow.spawn('g_ext', '{}', key => 'child');
SELECT flow.fail('declined', keep_writes => true);
-- fail and retry_after raise their decision (FL020, FL021): outside a handler nothing takes it
SELECT flow.fail('declined');
SELECT flow.retry_after('1 s');
-- a delay that is not positive: FL005
SELECT flow.retry_after('-1 s');
ROLLBACK;

-- ================================================================ flow.claim, flow.heartbeat, flow.resolve, flow.complete
-- a leased claim, its heartbeat, what resolve says before and after the completion
BEGIN;
SELECT flow.define('g_worker', NULL, max_attempts => 3);
SELECT flow.enqueue('g_worker', '{"x": 1}', key => 'job-1') AS run \gset
CREATE TEMP TABLE claimed AS SELECT * FROM flow.claim(array['g_worker'], 'w1', 10, '1 minute');
SELECT name, version, queue, args, attempt, lease_token IS NOT NULL AS has_token,
       lease_expires_at > now() + interval '50 s' AS leased_a_minute, deadline,
       (context).run_key, (context).command_key, (context).attempt AS context_attempt
FROM claimed;
SELECT command_id AS cmd, lease_token AS token FROM claimed \gset
SELECT status, attempts, lease_owner FROM flow.commands WHERE id = :'cmd';
SELECT lease_expires_at > now() + interval '50 s' AS extended, cancelled FROM flow.heartbeat(:'cmd', :'token');
SELECT state, outcome FROM flow.resolve(:'cmd', :'token');
SELECT flow.complete(:'cmd', :'token', '{"done": true}');
SELECT state, outcome FROM flow.resolve(:'cmd', :'token');
SELECT * FROM flow.await(:'run', '0 s');
-- completed already: FL017; not its lease: FL013; no such command: FL014
SELECT flow.complete(:'cmd', :'token');
SELECT flow.complete(:'cmd', '00000000-0000-0000-0000-000000000000');
SELECT flow.complete('00000000-0000-0000-0000-000000000000', :'token');
SELECT * FROM flow.heartbeat(:'cmd', '00000000-0000-0000-0000-000000000000');
SELECT * FROM flow.resolve(:'cmd', '00000000-0000-0000-0000-000000000000');
-- nothing due now: no rows (held or leased)
SELECT count(*) AS claimed FROM flow.claim(array['g_worker'], 'w1', 10, hold => true);
-- no such definition: FL001; a max below 1: FL015; a negative lease: FL005; no worker name: FL002
SELECT * FROM flow.claim(array['g_nothing'], 'w1');
SELECT * FROM flow.claim(array['g_worker'], 'w1', 0);
SELECT * FROM flow.claim(array['g_worker'], 'w1', 1, '-1 s');
SELECT * FROM flow.claim(array['g_worker'], '');
ROLLBACK;

-- a held claim: no lease, held by this transaction (resolve: held; heartbeat: nothing to extend)
BEGIN;
SELECT flow.define('g_held', NULL);
SELECT flow.enqueue('g_held', '{"x": 2}') AS run \gset
CREATE TEMP TABLE held AS SELECT * FROM flow.claim(array['g_held'], 'w2', 10, hold => true);
SELECT name, args, attempt, lease_token IS NOT NULL AS has_token, lease_expires_at FROM held;
SELECT command_id AS cmd, lease_token AS token FROM held \gset
SELECT * FROM flow.heartbeat(:'cmd', :'token');
SELECT state, outcome FROM flow.resolve(:'cmd', :'token');
SELECT status FROM flow.complete_many(array[:'cmd']::uuid[], array[:'token']::uuid[]);
SELECT status, attempts, lease_owner FROM flow.commands WHERE id = :'cmd';
ROLLBACK;

-- complete with events and children: they join the run, which ends with its last command
BEGIN;
SELECT flow.define('g_parent', NULL);
SELECT flow.define('g_child', NULL);
SELECT flow.enqueue('g_parent') AS run \gset
SELECT command_id AS cmd, lease_token AS token FROM flow.claim(array['g_parent'], 'w1') \gset
-- events that are no array: FL003; a child without a name: FL002; a result too large: FL004
SELECT flow.complete(:'cmd', :'token', NULL, '{"not": "an array"}');
SELECT flow.complete(:'cmd', :'token', NULL, NULL, '[{"name": null, "key": "k"}]');
SELECT flow.complete(:'cmd', :'token', jsonb_build_object('big', repeat('x', 300000)));
SELECT flow.complete(:'cmd', :'token', '{"root": 1}',
                     '[{"name": "g_paid", "key": "o-1", "payload": {"amount": 5}}]',
                     '[{"name": "g_child", "key": "ship", "args": {"n": 1}},
                       {"name": "g_child", "key": "later", "waits": [{"name": "g_go", "key": "o-1"}],
                        "within": "1 hour"}]');
SELECT key, name, status, args, parent_id IS NOT NULL AS has_parent FROM flow.commands WHERE run_id = :'run'
ORDER BY key;
SELECT name, key, event_position FROM flow.waits WHERE run_id = :'run';
SELECT name, key, payload FROM flow.events WHERE name = 'g_paid';
SELECT status FROM flow.runs WHERE id = :'run';
-- flow.run_graph: the run as dot and as mermaid (ids, and the event's position, replaced)
SELECT golden.ids_out(flow.run_graph(:'run')) AS dot;
SELECT golden.ids_out(flow.run_graph(:'run', 'mermaid')) AS mermaid;
-- another format: FL003
SELECT flow.run_graph(:'run', 'png');
-- no such run: FL014
SELECT flow.run_graph('00000000-0000-0000-0000-000000000000');
ROLLBACK;

-- ================================================================ flow.complete_many
-- one status per command: succeeded, lease_lost (nothing changed), already_completed
BEGIN;
SELECT flow.define('g_batch', NULL);
SELECT cardinality(flow.enqueue_many('g_batch', array_fill('{}'::jsonb, array[3]))) AS runs;
CREATE TEMP TABLE batch AS
    SELECT command_id, lease_token, row_number() OVER () AS n FROM flow.claim(array['g_batch'], 'w1', 3, '1 minute');
-- the first with a token that is not its own
SELECT status, count(*) FROM flow.complete_many(
    (SELECT array_agg(command_id ORDER BY n) FROM batch),
    (SELECT array_agg(CASE WHEN n = 1 THEN '00000000-0000-0000-0000-000000000000' ELSE lease_token END ORDER BY n)
     FROM batch),
    array['{"r": 1}', '{"r": 2}', '{"r": 3}']::jsonb[])
GROUP BY status ORDER BY status;
SELECT status, count(*) FROM flow.complete_many(
    (SELECT array_agg(command_id ORDER BY n) FROM batch), (SELECT array_agg(lease_token ORDER BY n) FROM batch))
GROUP BY status ORDER BY status;
SELECT c.status, c.result FROM flow.commands c JOIN batch b ON b.command_id = c.id ORDER BY b.n;
-- arrays of different lengths: FL003
SELECT * FROM flow.complete_many((SELECT array_agg(command_id) FROM batch), array[gen_random_uuid()]);
ROLLBACK;

-- ================================================================ flow.fail (an external worker's)
-- retried per the policy (after retry_after when given), or failed for good
BEGIN;
SELECT flow.define('g_failing', NULL, max_attempts => 3, backoff => '1 hour', backoff_max => '2 hours');
SELECT cardinality(flow.enqueue_many('g_failing', array['{"n": 1}', '{"n": 2}']::jsonb[])) AS runs;
CREATE TEMP TABLE failing AS
    SELECT command_id, run_id, lease_token, args ->> 'n' AS n FROM flow.claim(array['g_failing'], 'w1', 2);
SELECT command_id AS one, lease_token AS one_token FROM failing WHERE n = '1' \gset
SELECT command_id AS two, lease_token AS two_token, run_id AS two_run FROM failing WHERE n = '2' \gset
-- a retry_after that is not positive: FL005
SELECT flow.fail(:'one', :'one_token', 'x', retry_after => '-1 s');
SELECT flow.fail(:'one', :'one_token', 'rate limited', retry_after => '10 min');
SELECT status, attempts, next_run_at > now() + interval '9 min' AS in_10_min, last_error_code, last_error_message
FROM flow.commands WHERE id = :'one';
SELECT flow.fail(:'two', :'two_token', 'bad card', permanent => true, code => 'card_declined');
SELECT status, attempts, stop_reason, last_error_code, last_error_message FROM flow.commands WHERE id = :'two';
SELECT status, error ->> 'message' AS message, error ->> 'code' AS code, error ->> 'stop_reason' AS stop_reason
FROM flow.runs WHERE id = :'two_run';
SELECT attempt, outcome, error_code, error_message, owner FROM flow.attempts
WHERE command_id IN (:'one', :'two') ORDER BY error_message;
-- its lease is gone: FL013
SELECT flow.fail(:'one', :'one_token', 'again');
ROLLBACK;

-- ================================================================ the views
SELECT c.table_name AS view, c.column_name, c.data_type
FROM information_schema.columns c
JOIN information_schema.views v ON v.table_schema = c.table_schema AND v.table_name = c.table_name
WHERE c.table_schema = 'flow' AND c.table_name NOT LIKE '\_%'
ORDER BY c.table_name, c.ordinal_position;
