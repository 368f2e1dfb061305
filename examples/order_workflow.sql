-- An order workflow in plain SQL: the root command spawns `charge` and
-- `reserve_stock`; each emits an event; `ship` waits on both events (within
-- 30 s, or args.within) and ships, or compensates when an event never
-- arrived: it refunds the charge and fails the order, keeping the refund.
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.charges (order_id text PRIMARY KEY, amount numeric, refunded boolean DEFAULT false);
CREATE TABLE IF NOT EXISTS shop.reservations (order_id text PRIMARY KEY, sku text);
CREATE TABLE IF NOT EXISTS shop.shipments (order_id text PRIMARY KEY, shipped_at timestamptz DEFAULT now());

CREATE OR REPLACE FUNCTION shop.place_order(args jsonb, ctx flow.context) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    o text := args->>'order';
BEGIN
    PERFORM flow.spawn('charge', jsonb_build_object('order', o, 'amount', args->'amount'), key => 'charge');
    PERFORM flow.spawn('reserve_stock', jsonb_build_object('order', o, 'sku', args->'sku'), key => 'reserve');
    PERFORM flow.spawn('ship', jsonb_build_object('order', o), key => 'ship',
                       waits => array[flow.wait('charged', o), flow.wait('reserved', o)],
                       within => coalesce((args->>'within')::interval, '30 seconds'));
    RETURN jsonb_build_object('order', o, 'placed_by', current_user, 'run', ctx.run_id);
END $$;

CREATE OR REPLACE FUNCTION shop.charge(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO shop.charges (order_id, amount) VALUES (args->>'order', (args->>'amount')::numeric);
    PERFORM flow.emit('charged', args->>'order', jsonb_build_object('amount', args->'amount'));
    RETURN jsonb_build_object('charged', args->'amount');
END $$;

CREATE OR REPLACE FUNCTION shop.reserve_stock(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    IF args->>'sku' = 'unicorn' THEN
        RETURN jsonb_build_object('reserved', false, 'reason', 'out of stock');   -- no event: ship will wait in vain
    END IF;
    INSERT INTO shop.reservations VALUES (args->>'order', args->>'sku');
    PERFORM flow.emit('reserved', args->>'order', jsonb_build_object('sku', args->'sku'));
    RETURN jsonb_build_object('reserved', args->'sku');
END $$;

CREATE OR REPLACE FUNCTION shop.ship(args jsonb, ctx flow.context) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    IF ctx.wait_timed_out THEN
        -- the saga's compensation: refund what was charged, then fail the
        -- order for good; keep_writes => true commits the refund with the failure
        UPDATE shop.charges SET refunded = true WHERE order_id = args->>'order';
        PERFORM flow.fail('not shipped, still missing: ' || ctx.missing::text, keep_writes => true);
        RETURN NULL;
    END IF;
    INSERT INTO shop.shipments (order_id) VALUES (args->>'order');
    RETURN jsonb_build_object('shipped', args->>'order', 'inputs', ctx.inputs);
END $$;

SELECT flow.define('place_order', 'shop.place_order'::regproc);
SELECT flow.define('charge', 'shop.charge'::regproc, max_attempts => 3);
SELECT flow.define('reserve_stock', 'shop.reserve_stock'::regproc);
SELECT flow.define('ship', 'shop.ship'::regproc, timeout => '10 seconds');
