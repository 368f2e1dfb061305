-- Recover: concluding attempts whose owner is gone (rule 8).

-- Conclude attempts whose owner is provably gone (rule 8): an in-database
-- worker whose (pid, backend start) no longer exists, or an external lease
-- past its expiry by the database clock. Returns how many were concluded.
-- (A worker that exited without a record of its last attempt, as after a
-- crash restart, has every command it held charged: the conservative side
-- of rule 3.)
CREATE FUNCTION flow._recover() RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lost record;
    concluded integer := 0;
BEGIN
    FOR lost IN
        SELECT c.id, c.lease_token, c.lease_pid IS NULL AS external,
               CASE WHEN c.lease_pid IS NOT NULL THEN flow._stopped_in(c.lease_pid, c.lease_backend_start) END AS stopped_in
        FROM flow._commands c                                       -- index _commands_running
        WHERE c.status = 'running'
          AND CASE WHEN c.lease_pid IS NULL THEN c.lease_expires_at < now()
                   ELSE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                                    WHERE a.pid = c.lease_pid AND a.backend_start = c.lease_backend_start) END
    LOOP
        -- A worker that was told to stop is charged only for the attempt it
        -- was in: the other commands it held never started theirs (or had it
        -- rolled back with the worker's chunk), so they go back uncharged.
        IF lost.stopped_in IS NOT NULL AND lost.stopped_in <> lost.id THEN
            PERFORM flow._release(ARRAY[lost.id], ARRAY[lost.lease_token]);
            CONTINUE;
        END IF;
        -- a run locked elsewhere (an external client idle in its transaction, a
        -- long chunk) is concluded on a later round, never waited for
        CONTINUE WHEN NOT flow._try_lock_run_of(lost.id);
        IF flow._settle_failure(lost.id, lost.lease_token,
               CASE WHEN lost.external THEN 'lease_lost' ELSE 'interrupted' END,
               CASE WHEN lost.external THEN 'lease_lost' ELSE 'owner_died' END,
               CASE WHEN lost.external THEN 'the lease expired before the command was settled'
                    ELSE 'the worker running this attempt exited before settling it' END) <> 'expired' THEN
            concluded := concluded + 1;
        END IF;
    END LOOP;
    RETURN concluded;
END $$;
