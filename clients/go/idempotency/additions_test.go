package idempotency

// Tests of what the PostgreSQL store and the guard add to the reference:
// the token in the context, release on handler error, the heartbeat, the
// one-transaction helper, typed errors and the unavailable cases.

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

var bg = context.Background()

func okHandler(calls *atomic.Int32) func(context.Context) (Response, error) {
	return func(context.Context) (Response, error) {
		calls.Add(1)
		return Response{Status: 200, Body: []byte("ok")}, nil
	}
}

func TestTokenInContext(t *testing.T) {
	store := newTestStore(t)
	now := base
	g := &Guard{Store: store, Lease: testLease, Retention: time.Hour, Now: func() time.Time { return now }}
	var seen []int64
	h := func(ctx context.Context) (Response, error) {
		token, ok := TokenFromContext(ctx)
		claim, _ := ClaimFromContext(ctx)
		if !ok || token <= 0 || claim.Key != "tok-1" {
			t.Errorf("handler context: token=%d ok=%v claim=%+v", token, ok, claim)
		}
		// The claim is committed before the handler runs: the key shows it.
		if st := lookup(t, store.Scope, "tok-1"); !st.found || st.state != "PROCESSING" || st.token != token {
			t.Errorf("during handler: %+v, token %d", st, token)
		}
		seen = append(seen, token)
		return Response{Status: 200, Body: []byte("ok")}, nil
	}
	fail := true
	store.Fault = func(op string) error {
		if op == "complete" && fail {
			fail = false
			return errors.New("injected")
		}
		return nil
	}
	if _, out, err := g.Do(bg, "tok-1", "fp", h); out != Executed || err == nil {
		t.Fatalf("first: out=%s err=%v", out, err)
	}
	now = now.Add(pastLease)
	if _, out, err := g.Do(bg, "tok-1", "fp", h); out != Executed || err != nil {
		t.Fatalf("takeover: out=%s err=%v", out, err)
	}
	if len(seen) != 2 || seen[1] <= seen[0] {
		t.Fatalf("tokens %v: the takeover's must be greater", seen)
	}
	if st := lookup(t, store.Scope, "tok-1"); st.state != "DONE" || st.token != seen[1] || st.status == nil || *st.status != 200 {
		t.Fatalf("after complete: %+v, want DONE with token %d", st, seen[1])
	}
	if _, ok := TokenFromContext(bg); ok {
		t.Fatal("a context without a claim has a token")
	}
	// A claim for another key is not sent: Complete without a token is
	// refused outside the claiming transaction.
	rec, claimed, err := store.Begin(bg, "tok-2", "fp", now, testLease, time.Hour)
	if err != nil || !claimed || rec.Token <= seen[1] {
		t.Fatalf("begin tok-2: rec=%+v claimed=%v err=%v", rec, claimed, err)
	}
	err = store.Complete(WithClaim(bg, Claim{Key: "tok-1", Token: rec.Token}), "tok-2", "fp", Response{Status: 200}, now, time.Hour)
	if !errors.Is(err, ErrNoClaim) {
		t.Fatalf("complete with another key's claim: %v, want ErrNoClaim", err)
	}
	if err := store.Complete(WithClaim(bg, Claim{Key: "tok-2", Token: rec.Token}), "tok-2", "fp", Response{Status: 201}, now, time.Hour); err != nil {
		t.Fatalf("complete tok-2: %v", err)
	}
}

func TestReleaseOnHandlerError(t *testing.T) {
	handlerErr := errors.New("provider down")
	for _, release := range []bool{true, false} {
		name := map[bool]string{true: "release", false: "keep_until_lease"}[release]
		t.Run(name, func(t *testing.T) {
			store := newTestStore(t)
			now := base
			g := &Guard{Store: store, Lease: testLease, Retention: time.Hour, Now: func() time.Time { return now },
				ReleaseOnError: release}
			var calls atomic.Int32
			failing := func(ctx context.Context) (Response, error) {
				calls.Add(1)
				return Response{Status: 502}, handlerErr
			}
			resp, out, err := g.Do(bg, "rel-1", "fp", failing)
			if out != Executed || !errors.Is(err, handlerErr) || resp.Status != 502 {
				t.Fatalf("failing handler: out=%s err=%v resp=%+v", out, err, resp)
			}
			st := lookup(t, store.Scope, "rel-1")
			if release {
				if st.found {
					t.Fatalf("after release the key is still stored: %+v", st)
				}
				if _, out, err := g.Do(bg, "rel-1", "fp", okHandler(&calls)); out != Executed || err != nil || calls.Load() != 2 {
					t.Fatalf("retry: out=%s err=%v calls=%d", out, err, calls.Load())
				}
			} else {
				if !st.found || st.state != "PROCESSING" {
					t.Fatalf("kept claim: %+v", st)
				}
				if _, out, err := g.Do(bg, "rel-1", "fp", okHandler(&calls)); out != InFlight || !errors.Is(err, ErrInFlight) || calls.Load() != 1 {
					t.Fatalf("retry inside lease: out=%s err=%v calls=%d", out, err, calls.Load())
				}
				now = now.Add(pastLease)
				if _, out, err := g.Do(bg, "rel-1", "fp", okHandler(&calls)); out != Executed || err != nil || calls.Load() != 2 {
					t.Fatalf("retry after lease: out=%s err=%v calls=%d", out, err, calls.Load())
				}
			}
			if st := lookup(t, store.Scope, "rel-1"); st.state != "DONE" {
				t.Fatalf("end: %+v", st)
			}
		})
	}
}

func TestHeartbeat(t *testing.T) {
	t.Run("keeps_the_claim", func(t *testing.T) {
		store := NewPostgresStore(testPool) // server clock
		store.Scope = newScope(t)
		var count opCounter
		store.Fault = count.fault
		// The heartbeat extends a 3 s lease every second, so the claim
		// lapses only if the heartbeat is two seconds late.
		const lease = 3 * time.Second
		const period = lease / 3
		g := &Guard{Store: store, Lease: lease, Retention: time.Hour, Heartbeat: true}
		other := &Guard{Store: store, Lease: lease, Retention: time.Hour}
		var calls atomic.Int32
		start := time.Now()
		_, out, err := g.Do(bg, "hb-1", "fp", func(ctx context.Context) (Response, error) {
			// Wait for an extend to move the lease, then until the
			// server's clock is past the lease as that extend left it:
			// the key is still in flight then only if a later extend moved
			// the lease again.
			leaseNow := func() time.Time {
				st := lookup(t, store.Scope, "hb-1")
				if st.state != "PROCESSING" || st.lease == nil {
					t.Fatalf("during the handler: %+v", st)
				}
				return *st.lease
			}
			first := leaseNow()
			var renewed time.Time
			if !waitFor(30*time.Second, func() bool { renewed = leaseNow(); return renewed.After(first) }) {
				t.Errorf("lease not extended within 30 s (extends=%d)", count.extends())
				return Response{}, errors.New("no heartbeat")
			}
			if !waitFor(30*time.Second, func() bool { return serverPast(t, renewed) }) {
				t.Errorf("the server's clock did not pass %v", renewed)
			}
			_, o, e := other.Do(bg, "hb-1", "fp", okHandler(&calls))
			if o != InFlight || !errors.Is(e, ErrInFlight) {
				t.Errorf("second caller after the renewed lease: out=%s err=%v", o, e)
			}
			if ctx.Err() != nil {
				t.Errorf("handler context cancelled: %v", ctx.Err())
			}
			return Response{Status: 200, Body: []byte("done")}, nil
		})
		elapsed := time.Since(start)
		if out != Executed || err != nil || calls.Load() != 0 {
			t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
		}
		// At least two extends kept the key in flight; the heartbeat's
		// ticker fires at most once a period.
		if n := count.extends(); n < 2 || n > int64(elapsed/period) {
			t.Fatalf("extends=%d in %v, want 2 to %d (one every %v)", n, elapsed, int64(elapsed/period), period)
		}
		after := count.extends()
		time.Sleep(period + period/2)
		if count.extends() != after {
			t.Fatalf("heartbeat still running after Do returned")
		}
		if st := lookup(t, store.Scope, "hb-1"); st.state != "DONE" {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("stops_on_superseded_token", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		var count opCounter
		store.Fault = count.fault
		g := &Guard{Store: store, Lease: 600 * time.Millisecond, Retention: time.Hour, Heartbeat: true}
		// A caller ten minutes ahead takes the key over.
		ahead := NewPostgresStore(testPool)
		ahead.Scope = store.Scope
		ahead.ClientClock = true
		var first, second int64
		var frozen, later int64
		_, out, err := g.Do(bg, "hb-2", "fp", func(ctx context.Context) (Response, error) {
			first, _ = TokenFromContext(ctx)
			if !waitFor(30*time.Second, func() bool { return count.extends() >= 1 }) {
				t.Errorf("no heartbeat within 30 s")
			}
			rec, claimed, err := ahead.Begin(bg, "hb-2", "fp", time.Now().Add(10*time.Minute), time.Minute, time.Hour)
			if err != nil || !claimed {
				t.Errorf("takeover: claimed=%v err=%v", claimed, err)
			}
			second = rec.Token
			select {
			case <-ctx.Done():
			case <-time.After(30 * time.Second):
				t.Errorf("handler context not cancelled after the takeover")
			}
			frozen = count.extends()
			time.Sleep(700 * time.Millisecond) // three more periods
			later = count.extends()
			return Response{Status: 200, Body: []byte("late")}, nil
		})
		if out != Executed || !errors.Is(err, ErrSuperseded) {
			t.Fatalf("stale holder: out=%s err=%v, want Executed with ErrSuperseded", out, err)
		}
		if second <= first || frozen != later {
			t.Fatalf("tokens %d then %d; extends %d then %d (must stop)", first, second, frozen, later)
		}
		if st := lookup(t, store.Scope, "hb-2"); st.state != "PROCESSING" || st.token != second {
			t.Fatalf("key: %+v, want the taker's claim %d", st, second)
		}
	})
}

// setupStock makes a fresh stock table with qty 10 of sku A.
func setupStock(t *testing.T) {
	t.Helper()
	_, err := testPool.Exec(bg, `DROP TABLE IF EXISTS go_stock, go_reservations;
		CREATE TABLE go_stock (sku text PRIMARY KEY, qty integer NOT NULL);
		CREATE TABLE go_reservations (key text PRIMARY KEY, sku text NOT NULL);
		INSERT INTO go_stock VALUES ('A', 10)`)
	if err != nil {
		t.Fatal(err)
	}
}

func stockState(t *testing.T) (qty, reservations int) {
	t.Helper()
	if err := testPool.QueryRow(bg, `SELECT (SELECT qty FROM go_stock WHERE sku = 'A'),
		(SELECT count(*) FROM go_reservations)::integer`).Scan(&qty, &reservations); err != nil {
		t.Fatal(err)
	}
	return qty, reservations
}

func reserveTx(key string, calls *atomic.Int32, fail error) func(context.Context, pgx.Tx) (Response, error) {
	return func(ctx context.Context, tx pgx.Tx) (Response, error) {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `UPDATE go_stock SET qty = qty - 1 WHERE sku = 'A'`); err != nil {
			return Response{}, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO go_reservations VALUES ($1, 'A')`, key); err != nil {
			return Response{}, err
		}
		time.Sleep(20 * time.Millisecond)
		if fail != nil {
			return Response{Status: 500}, fail
		}
		return Response{Status: 201, Body: []byte(`{"reserved":"A"}`)}, nil
	}
}

func TestDoTx(t *testing.T) {
	t.Run("commit_eight_clients", func(t *testing.T) {
		setupStock(t)
		store := newTestStore(t)
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }}
		var calls atomic.Int32
		const clients = 8
		outs := make([]Outcome, clients)
		resps := make([]Response, clients)
		var wg sync.WaitGroup
		for i := 0; i < clients; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				var err error
				resps[i], outs[i], err = g.DoTx(bg, "tx-1", "sku=A&qty=1", reserveTx("tx-1", &calls, nil))
				if err != nil {
					t.Errorf("client %d: %v", i, err)
				}
			}(i)
		}
		wg.Wait()
		executed, replayed := 0, 0
		for i, out := range outs {
			switch out {
			case Executed:
				executed++
			case Replayed:
				replayed++
			}
			if resps[i].Status != 201 || string(resps[i].Body) != `{"reserved":"A"}` {
				t.Errorf("client %d: %s %+v", i, out, resps[i])
			}
		}
		qty, res := stockState(t)
		if executed != 1 || replayed != clients-1 || calls.Load() != 1 || qty != 9 || res != 1 {
			t.Fatalf("executed=%d replayed=%d calls=%d stock=%d reservations=%d outcomes=%v",
				executed, replayed, calls.Load(), qty, res, outs)
		}
		if st := lookup(t, store.Scope, "tx-1"); st.state != "DONE" || *st.status != 201 {
			t.Fatalf("%+v", st)
		}
		if _, out, err := g.DoTx(bg, "tx-1", "sku=A&qty=2", reserveTx("tx-1", &calls, nil)); out != Conflicted || !errors.Is(err, ErrConflict) || calls.Load() != 1 {
			t.Fatalf("conflict: out=%s err=%v calls=%d", out, err, calls.Load())
		}
	})
	t.Run("handler_error_rolls_back", func(t *testing.T) {
		setupStock(t)
		store := newTestStore(t)
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }}
		var calls atomic.Int32
		boom := errors.New("card declined")
		resp, out, err := g.DoTx(bg, "tx-2", "fp", reserveTx("tx-2", &calls, boom))
		if out != Executed || !errors.Is(err, boom) || resp.Status != 500 {
			t.Fatalf("out=%s err=%v resp=%+v", out, err, resp)
		}
		if qty, res := stockState(t); qty != 10 || res != 0 {
			t.Fatalf("after rollback: stock=%d reservations=%d", qty, res)
		}
		if st := lookup(t, store.Scope, "tx-2"); st.found {
			t.Fatalf("claim survived the rollback: %+v", st)
		}
		if _, out, err := g.DoTx(bg, "tx-2", "fp", reserveTx("tx-2", &calls, nil)); out != Executed || err != nil || calls.Load() != 2 {
			t.Fatalf("retry: out=%s err=%v calls=%d", out, err, calls.Load())
		}
		if qty, res := stockState(t); qty != 9 || res != 1 {
			t.Fatalf("after retry: stock=%d reservations=%d", qty, res)
		}
	})
	t.Run("complete_failure_rolls_back", func(t *testing.T) {
		setupStock(t)
		store := newTestStore(t)
		store.Fault = func(op string) error {
			if op == "complete" {
				return errors.New("injected")
			}
			return nil
		}
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }}
		var calls atomic.Int32
		if _, out, err := g.DoTx(bg, "tx-3", "fp", reserveTx("tx-3", &calls, nil)); out != Executed || err == nil || calls.Load() != 1 {
			t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
		}
		if qty, res := stockState(t); qty != 10 || res != 0 {
			t.Fatalf("stock=%d reservations=%d", qty, res)
		}
		if st := lookup(t, store.Scope, "tx-3"); st.found {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("needs_postgres_store", func(t *testing.T) {
		g := &Guard{Store: NewMemoryStore()}
		var calls atomic.Int32
		if _, out, err := g.DoTx(bg, "tx-4", "fp", reserveTx("tx-4", &calls, nil)); out != Unavailable || !errors.Is(err, ErrUnavailable) || calls.Load() != 0 {
			t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
		}
	})
}

func TestTypedErrors(t *testing.T) {
	check := func(t *testing.T, err error, code string, sentinel error) {
		t.Helper()
		var ie *Error
		var pg *pgconn.PgError
		if !errors.Is(err, sentinel) || !errors.As(err, &ie) || ie.Code != code || !errors.As(err, &pg) || pg.Code != code {
			t.Fatalf("err=%v, want %s matching %v", err, code, sentinel)
		}
		for _, other := range []error{ErrFingerprintMismatch, ErrSuperseded, ErrNoClaim, ErrAlreadyCompleted} {
			if other != sentinel && errors.Is(err, other) {
				t.Fatalf("%s also matches %v", code, other)
			}
		}
	}
	store := newTestStore(t)
	now := base
	claim := func(t *testing.T, key string) int64 {
		t.Helper()
		rec, claimed, err := store.Begin(bg, key, "fp", now, testLease, time.Hour)
		if err != nil || !claimed || rec.Token == 0 || rec.State != Processing {
			t.Fatalf("claim %s: rec=%+v claimed=%v err=%v", key, rec, claimed, err)
		}
		return rec.Token
	}
	with := func(key string, token int64) context.Context {
		return WithClaim(bg, Claim{Key: key, Token: token})
	}
	t.Run("ID001_fingerprint", func(t *testing.T) {
		tok := claim(t, "e1")
		err := store.Complete(with("e1", tok), "e1", "other", Response{Status: 200}, now, time.Hour)
		check(t, err, "ID001", ErrFingerprintMismatch)
		if !errors.Is(err, ErrConflict) {
			t.Fatalf("ID001 does not match ErrConflict")
		}
		if st := lookup(t, store.Scope, "e1"); st.state != "PROCESSING" || st.token != tok {
			t.Fatalf("failed complete changed the key: %+v", st)
		}
	})
	t.Run("ID002_superseded", func(t *testing.T) {
		stale := claim(t, "e2")
		now = now.Add(pastLease)
		fresh := claim(t, "e2")
		if fresh <= stale {
			t.Fatalf("takeover token %d not greater than %d", fresh, stale)
		}
		check(t, store.Complete(with("e2", stale), "e2", "fp", Response{Status: 200}, now, time.Hour), "ID002", ErrSuperseded)
		_, err := store.Extend(bg, "e2", stale, now, time.Second)
		check(t, err, "ID002", ErrSuperseded)
		_, err = store.Release(bg, "e2", stale, now)
		check(t, err, "ID002", ErrSuperseded)
		if st := lookup(t, store.Scope, "e2"); st.state != "PROCESSING" || st.token != fresh {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("ID003_no_claim", func(t *testing.T) {
		err := store.Complete(with("e3", 1), "e3", "fp", Response{Status: 200}, now, time.Hour)
		check(t, err, "ID003", ErrNoClaim)
		if !errors.Is(err, ErrConflict) {
			t.Fatalf("ID003 does not match ErrConflict")
		}
		_, err = store.Extend(bg, "e3", 1, now, time.Second)
		check(t, err, "ID003", ErrNoClaim)
		if st := lookup(t, store.Scope, "e3"); st.found {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("ID004_already_completed", func(t *testing.T) {
		tok := claim(t, "e4")
		if err := store.Complete(with("e4", tok), "e4", "fp", Response{Status: 200, Body: []byte("a")}, now, time.Hour); err != nil {
			t.Fatal(err)
		}
		check(t, store.Complete(with("e4", tok), "e4", "fp", Response{Status: 201, Body: []byte("b")}, now, time.Hour), "ID004", ErrAlreadyCompleted)
		_, err := store.Release(bg, "e4", tok, now)
		check(t, err, "ID004", ErrAlreadyCompleted)
		rec, claimed, err := store.Begin(bg, "e4", "fp", now, time.Second, time.Hour)
		if err != nil || claimed || rec.State != Done || rec.Response.Status != 200 || string(rec.Response.Body) != "a" {
			t.Fatalf("replay: rec=%+v claimed=%v err=%v", rec, claimed, err)
		}
	})
	t.Run("release_and_extend", func(t *testing.T) {
		tok := claim(t, "e5")
		// The server runs the call within half a second of now, later by
		// as much as the call takes between setting the offset and
		// extending.
		start := time.Now()
		until, err := store.Extend(bg, "e5", tok, now, time.Minute)
		took := time.Since(start)
		if err != nil || until.Before(now.Add(59*time.Second)) || until.After(now.Add(61*time.Second+took)) {
			t.Fatalf("extend: until=%v (now %v, call took %v) err=%v", until, now, took, err)
		}
		ok, err := store.Release(bg, "e5", tok, now)
		if err != nil || !ok {
			t.Fatalf("release: %v %v", ok, err)
		}
		if ok, err := store.Release(bg, "e5", tok, now); err != nil || ok {
			t.Fatalf("second release: %v %v, want false", ok, err)
		}
		if st := lookup(t, store.Scope, "e5"); st.found {
			t.Fatalf("%+v", st)
		}
	})
}

func TestUnavailable(t *testing.T) {
	t.Run("connection_refused", func(t *testing.T) {
		// A socket directory of the test's own, with no server in it.
		pool := newPool(t, "host="+t.TempDir()+" port=1 user=postgres dbname=postgres connect_timeout=2", nil, true)
		g := &Guard{Store: NewPostgresStore(pool), Lease: time.Second, Retention: time.Hour}
		var calls atomic.Int32
		start := time.Now()
		_, out, err := g.Do(bg, "down-1", "fp", okHandler(&calls))
		if out != Unavailable || !errors.Is(err, ErrUnavailable) || calls.Load() != 0 || time.Since(start) > 5*time.Second {
			t.Fatalf("out=%s err=%v calls=%d after %v", out, err, calls.Load(), time.Since(start))
		}
	})
	t.Run("read_only_25006", func(t *testing.T) {
		pool := newPool(t, dsn(), map[string]string{"default_transaction_read_only": "on"}, false)
		store := NewPostgresStore(pool)
		store.Scope = newScope(t)
		_, _, err := store.Begin(bg, "ro-1", "fp", time.Now(), time.Second, time.Hour)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "25006" {
			t.Fatalf("begin on a read-only server: %v, want 25006", err)
		}
		g := &Guard{Store: store, Lease: time.Second, Retention: time.Hour}
		var calls atomic.Int32
		if _, out, err := g.Do(bg, "ro-1", "fp", okHandler(&calls)); out != Unavailable || !errors.Is(err, ErrUnavailable) || calls.Load() != 0 {
			t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
		}
		if st := lookup(t, store.Scope, "ro-1"); st.found {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("unknown_state", func(t *testing.T) {
		// A newer server, played by a look-alike idem_begin: a state the
		// guard does not know is a failed claim, not in flight.
		if _, err := testPool.Exec(bg, `CREATE SCHEMA idem_future_go;
			CREATE FUNCTION idem_future_go.idem_begin(text, text, interval, interval, text, boolean)
			RETURNS TABLE (claimed boolean, state text, token bigint, status integer, body bytea,
			               lease_until timestamptz, expires_at timestamptz)
			LANGUAGE sql AS $$ SELECT false, 'TOMBSTONED', NULL::bigint, 200, pg_catalog.decode('6f6b', 'hex'),
			                          NULL::timestamptz, now() + interval '1 day' $$`); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { testPool.Exec(bg, "DROP SCHEMA idem_future_go CASCADE") })
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		store.Schema = "idem_future_go"
		g := &Guard{Store: store, Lease: time.Second, Retention: time.Hour}
		var calls atomic.Int32
		_, out, err := g.Do(bg, "future-1", "fp", okHandler(&calls))
		if out != Unavailable || !errors.Is(err, ErrUnavailable) || calls.Load() != 0 ||
			!strings.Contains(err.Error(), `unknown state "TOMBSTONED"`) {
			t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
		}
	})
	t.Run("missing_schema", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		store.Schema = "no_such_schema"
		g := &Guard{Store: store, Lease: time.Second, Retention: time.Hour}
		var calls atomic.Int32
		if _, out, err := g.Do(bg, "sch-1", "fp", okHandler(&calls)); out != Unavailable || !errors.Is(err, ErrUnavailable) || calls.Load() != 0 {
			t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
		}
	})
}

// waitingBackends counts backends of this database waiting for a lock.
func waitingBackends(t *testing.T) int {
	var n int
	if err := testPool.QueryRow(bg, `SELECT count(*)::integer FROM pg_catalog.pg_stat_activity
		WHERE datname = pg_catalog.current_database() AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestTimeoutCancelsServerWait(t *testing.T) {
	// Store.Timeout (lock_timeout on the server and a deadline), and the
	// caller's own deadline alone (pgx cancels the statement).
	t.Run("store_timeout", func(t *testing.T) { timeoutCase(t, true) })
	t.Run("caller_deadline", func(t *testing.T) { timeoutCase(t, false) })
}

func timeoutCase(t *testing.T, storeTimeout bool) {
	// The claim waits on the server for this long before the timeout cuts
	// it off: time enough for the test to see the backend waiting even if
	// the machine is slow to get the claim there.
	const timeout = 2 * time.Second
	store := NewPostgresStore(testPool)
	store.Scope = newScope(t)
	if storeTimeout {
		store.Timeout = timeout
	}
	// An open transaction holds an uncommitted claim of the key.
	holder, err := testPool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(bg)
	var claimed bool
	if err := holder.QueryRow(bg, `SELECT claimed FROM public.idem_begin($1::text, $2::text, NULL::interval,
		NULL::interval, $3::text, true)`, "wait-1", "fp", store.Scope).Scan(&claimed); err != nil || !claimed {
		t.Fatalf("holder claim: %v %v", claimed, err)
	}
	g := &Guard{Store: store, Lease: time.Second, Retention: time.Hour}
	var calls atomic.Int32
	type result struct {
		out Outcome
		err error
		d   time.Duration
	}
	done := make(chan result, 1)
	go func() {
		// The caller's deadline starts with the call, after the holder's
		// claim, so that it bounds the call alone.
		ctx := bg
		start := time.Now()
		if !storeTimeout {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(bg, timeout)
			defer cancel()
		}
		_, out, err := g.Do(ctx, "wait-1", "fp", okHandler(&calls))
		done <- result{out, err, time.Since(start)}
	}()
	// Watch for the backend waiting until the call returns.
	waited := false
	waitFor(timeout+30*time.Second, func() bool {
		if waitingBackends(t) == 1 {
			waited = true
			return true
		}
		return len(done) > 0
	})
	if !waited {
		t.Fatalf("the claim did not wait on the server")
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(timeout + 30*time.Second):
		t.Fatalf("the claim still waits %v after its timeout", 30*time.Second)
	}
	// Cut off by the timeout, not sooner, and not by anything much later.
	if r.out != Unavailable || !errors.Is(r.err, ErrUnavailable) || calls.Load() != 0 || r.d < timeout*9/10 || r.d > timeout+5*time.Second {
		t.Fatalf("out=%s err=%v calls=%d after %v (timeout %v)", r.out, r.err, calls.Load(), r.d, timeout)
	}
	if !waitFor(30*time.Second, func() bool { return waitingBackends(t) == 0 }) {
		t.Fatalf("a backend still waits after the timeout")
	}
	if err := holder.Rollback(bg); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if st := lookup(t, store.Scope, "wait-1"); st.found {
		t.Fatalf("orphan claim after the timeout: %+v", st)
	}
	// This call must succeed: a bound a slow machine cannot reach.
	if storeTimeout {
		store.Timeout = time.Minute
	}
	if _, out, err := g.Do(bg, "wait-1", "fp", okHandler(&calls)); out != Executed || err != nil || calls.Load() != 1 {
		t.Fatalf("after the holder rolled back: out=%s err=%v calls=%d", out, err, calls.Load())
	}
}

func TestBinaryBodyAndQualifiedCalls(t *testing.T) {
	// search_path without public: only schema-qualified calls work.
	pool := newPool(t, dsn(), map[string]string{"search_path": "pg_catalog"}, false)
	store := NewPostgresStore(pool)
	store.Scope = newScope(t)
	g := &Guard{Store: store, Lease: time.Second, Retention: time.Hour}
	body := make([]byte, 512)
	for i := range body {
		body[i] = byte(i)
	}
	var calls atomic.Int32
	h := func(context.Context) (Response, error) {
		calls.Add(1)
		return Response{Status: 200, Body: body}, nil
	}
	if _, out, err := g.Do(bg, "bin-1", "fp", h); out != Executed || err != nil {
		t.Fatalf("out=%s err=%v", out, err)
	}
	resp, out, err := g.Do(bg, "bin-1", "fp", h)
	if out != Replayed || err != nil || resp.Status != 200 || !bytes.Equal(resp.Body, body) || calls.Load() != 1 {
		t.Fatalf("replay: out=%s err=%v status=%d len=%d calls=%d", out, err, resp.Status, len(resp.Body), calls.Load())
	}
	if st := lookup(t, store.Scope, "bin-1"); st.size == nil || *st.size != 512 {
		t.Fatalf("%+v", st)
	}
	// An empty body is stored as empty, not NULL.
	if _, _, err := g.Do(bg, "bin-2", "fp", func(context.Context) (Response, error) { return Response{Status: 204}, nil }); err != nil {
		t.Fatal(err)
	}
	resp, out, _ = g.Do(bg, "bin-2", "fp", h)
	if out != Replayed || resp.Status != 204 || resp.Body == nil || len(resp.Body) != 0 {
		t.Fatalf("empty body: out=%s resp=%+v", out, resp)
	}
}

func TestLostCommitLeavesNoClaim(t *testing.T) {
	store := NewPostgresStore(testPool)
	store.Scope = newScope(t)
	lost := true
	store.commitLost = func() bool { return lost }
	g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour}
	var calls atomic.Int32
	if _, out, err := g.Do(bg, "lost-1", "fp", okHandler(&calls)); out != Unavailable || !errors.Is(err, ErrUnavailable) || calls.Load() != 0 {
		t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
	}
	// The claim did commit; the store released it, so the key is free now
	// instead of in flight for the minute of its lease.
	if st := lookup(t, store.Scope, "lost-1"); st.found {
		t.Fatalf("claim left behind: %+v", st)
	}
	lost = false
	if _, out, err := g.Do(bg, "lost-1", "fp", okHandler(&calls)); out != Executed || err != nil || calls.Load() != 1 {
		t.Fatalf("retry: out=%s err=%v calls=%d", out, err, calls.Load())
	}
}
