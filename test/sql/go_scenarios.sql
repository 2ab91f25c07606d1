--
-- The two scenarios of the Go guard's tests, in SQL: a ledger that
-- reserves stock and charges once per order, a handler that applies an
-- order to it, and a guard that claims the order's idempotency key, runs
-- the handler and completes the key.
--
-- The Go tests use a fake clock with a 1 s lease and a 1 h window and move
-- it by 2 s and 2 h.  A real clock runs between statements, so here the
-- lease is 1 minute and time moves by 2 minutes and 2 hours through
-- idem.clock_offset.
--
CREATE TABLE stock (sku text PRIMARY KEY, qty integer NOT NULL);
CREATE TABLE reservations (order_key text PRIMARY KEY, qty integer NOT NULL);
CREATE TABLE charges (order_key text PRIMARY KEY, cents integer NOT NULL);
CREATE TABLE handler_calls (id serial PRIMARY KEY, order_key text NOT NULL);
INSERT INTO stock VALUES ('A', 10);

-- The handler: counts its calls; applies an order at most once per key.
CREATE FUNCTION handler(order_key text, out status integer, out body bytea)
LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO handler_calls (order_key) VALUES (handler.order_key);
	IF EXISTS (SELECT FROM reservations r WHERE r.order_key = handler.order_key) THEN
		status := 200; body := 'paid';
		RETURN;
	END IF;
	IF (SELECT qty FROM stock WHERE sku = 'A') < 1 THEN
		status := 409; body := 'OUT_OF_STOCK';
		RETURN;
	END IF;
	UPDATE stock SET qty = qty - 1 WHERE sku = 'A';
	INSERT INTO reservations VALUES (handler.order_key, 1);
	INSERT INTO charges VALUES (handler.order_key, 1000);
	status := 200; body := 'paid';
END $$;

-- The guard's first step: claim the key, or say why not.
CREATE FUNCTION guard_claim(order_key text, fingerprint text,
                            out outcome text, out token bigint)
LANGUAGE plpgsql AS $$
DECLARE
	r record;
BEGIN
	SELECT * INTO r FROM idem_begin(order_key, fingerprint,
	                                lease => '1 minute', retention => '1 hour');
	token := r.token;
	outcome := CASE
		WHEN r.claimed THEN 'CLAIMED'
		WHEN r.state = 'DONE' THEN 'REPLAYED'
		WHEN r.state = 'CONFLICT' THEN 'CONFLICT'
		ELSE 'IN_FLIGHT' END;
END $$;

-- The whole guard: claim, run the handler, complete.  With complete =>
-- false the completion is lost (the store timed out): the side effect
-- stays and the key stays PROCESSING.
CREATE FUNCTION guard_do(order_key text, fingerprint text, complete boolean DEFAULT true)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	c record;
	h record;
BEGIN
	SELECT * INTO c FROM guard_claim(order_key, fingerprint);
	IF c.outcome <> 'CLAIMED' THEN
		RETURN c.outcome;
	END IF;
	SELECT * INTO h FROM handler(order_key);
	IF complete THEN
		PERFORM idem_complete(order_key, fingerprint, h.status, h.body, c.token,
		                      retention => '1 hour');
	END IF;
	RETURN 'EXECUTED';
END $$;

CREATE VIEW ledger AS
  SELECT (SELECT count(*) FROM handler_calls) AS calls,
         (SELECT qty FROM stock WHERE sku = 'A') AS stock,
         (SELECT count(*) FROM reservations) AS reservations,
         (SELECT count(*) FROM charges) AS charges;

--
-- TestConcurrentSameKeyAndFingerprintConflict: eight claimers of order-1,
-- one executes.  Worker 1 claims; workers 2-8 arrive while it runs and
-- find the key in flight; worker 1 then runs the handler and completes.
--
SELECT outcome AS w1_outcome, token AS w1_token
  FROM guard_claim('order-1', 'sku=A&qty=1') \gset
\echo worker 1: :w1_outcome
SELECT w AS worker, guard_do('order-1', 'sku=A&qty=1') AS outcome
  FROM generate_series(2, 8) w;
SELECT status AS w1_status, body AS w1_body FROM handler('order-1') \gset
SELECT idem_complete('order-1', 'sku=A&qty=1', :w1_status, :'w1_body', :w1_token,
                     retention => '1 hour') IS NOT NULL AS worker_1_completed;
SELECT * FROM ledger;
-- Late retries replay the stored response without running the handler.
SELECT claimed, state, status, convert_from(body, 'UTF8') AS body
  FROM idem_begin('order-1', 'sku=A&qty=1');
SELECT guard_do('order-1', 'sku=A&qty=1') AS outcome;
-- The same key with a changed fingerprint is a conflict; the handler does
-- not run.
SELECT guard_do('order-1', 'sku=A&qty=2') AS outcome;
SELECT * FROM ledger;

--
-- TestLeaseTakeoverFaultInjectionAndWindow on order-2, with a new ledger.
--
TRUNCATE handler_calls, reservations, charges;
UPDATE stock SET qty = 10;
-- The first call executes, but its completion is lost.
SELECT guard_do('order-2', 'sku=A&qty=1', complete => false) AS outcome;
SELECT state, status FROM idem_begin('order-2', 'sku=A&qty=1');
SELECT * FROM ledger;
-- Inside the lease the key is in flight; the handler does not run.
SELECT guard_do('order-2', 'sku=A&qty=1') AS outcome;
SELECT * FROM ledger;
-- After the lease the next call takes over and executes again; the
-- ledger's own dedup on the order absorbs the second run.
SET idem.clock_offset = '2min';
SELECT guard_do('order-2', 'sku=A&qty=1') AS outcome;
SELECT * FROM ledger;
SELECT guard_do('order-2', 'sku=A&qty=1') AS outcome;
-- After the window the key is new again and the handler runs a third time.
SET idem.clock_offset = '122min';
SELECT guard_do('order-2', 'sku=A&qty=1') AS outcome;
SELECT * FROM ledger;
RESET idem.clock_offset;
