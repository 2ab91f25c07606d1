package idempotency

// Tests of Guard.WaitFor: a duplicate of a request in flight waits for the
// first request's answer.  The cases run against both stores; PostgresStore
// waits in the server (idem_begin's wait_for), MemoryStore in the process.

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgconn"
)

// waitStore is a store under test and the number of callers waiting in it.
type waitStore struct {
	name    string
	open    func(t *testing.T) Store
	waiting func(t *testing.T) int
}

// memoryWaiting counts the callers waiting in s's BeginWait.
func (s *MemoryStore) memoryWaiting() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiting
}

// serverWaiting counts the backends of this database running an
// idem_begin with wait_for: in the scenarios below, the holder's claim is
// committed before the duplicate starts, so such a call is in the wait.
func serverWaiting(t *testing.T) int {
	t.Helper()
	var n int
	if err := testPool.QueryRow(bg, `SELECT count(*)::integer FROM pg_catalog.pg_stat_activity
		WHERE datname = pg_catalog.current_database() AND state = 'active'
		  AND pid <> pg_catalog.pg_backend_pid() AND query LIKE '%idem_begin(%$7::interval)%'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitStores are the two stores, each on the real clock (the server's for
// PostgresStore).  pool is the pool of the PostgreSQL store (testPool when
// nil).
func waitStores(pool func(t *testing.T) Store) []waitStore {
	var mem *MemoryStore
	return []waitStore{
		{
			name: "postgres",
			open: func(t *testing.T) Store {
				if pool != nil {
					return pool(t)
				}
				s := NewPostgresStore(testPool)
				s.Scope = newScope(t)
				return s
			},
			waiting: serverWaiting,
		},
		{
			name: "memory",
			open: func(t *testing.T) Store {
				mem = NewMemoryStore()
				return mem
			},
			waiting: func(*testing.T) int { return mem.memoryWaiting() },
		},
	}
}

// hold claims key for another caller, with lease, and returns its token.
func hold(t *testing.T, store Store, key string, lease time.Duration) Record {
	t.Helper()
	rec, claimed, err := store.Begin(bg, key, "fp", time.Now(), lease, time.Hour)
	if err != nil || !claimed || rec.Token == 0 {
		t.Fatalf("holder's claim: rec=%+v claimed=%v err=%v", rec, claimed, err)
	}
	return rec
}

// doResult is what one Guard.Do answered and how long it took.
type doResult struct {
	resp Response
	out  Outcome
	err  error
	took time.Duration
}

// doAsync runs g.Do in a goroutine; the channel receives its result.
func doAsync(ctx context.Context, g *Guard, key string, fn func(context.Context) (Response, error)) chan doResult {
	done := make(chan doResult, 1)
	go func() {
		start := time.Now()
		resp, out, err := g.Do(ctx, key, "fp", fn)
		done <- doResult{resp, out, err, time.Since(start)}
	}()
	return done
}

// awaitWaiting waits until n callers wait in the store, and fails if the
// duplicate answered first.
func awaitWaiting(t *testing.T, ws waitStore, n int, done chan doResult) {
	t.Helper()
	if !waitFor(30*time.Second, func() bool { return ws.waiting(t) == n || len(done) > 0 }) || len(done) > 0 {
		select {
		case r := <-done:
			t.Fatalf("the duplicate answered without waiting: out=%s err=%v after %v", r.out, r.err, r.took)
		default:
			t.Fatalf("no duplicate waits within 30 s (waiting: %d)", ws.waiting(t))
		}
	}
}

// result receives the duplicate's result, failing after bound.
func result(t *testing.T, done chan doResult, bound time.Duration) doResult {
	t.Helper()
	select {
	case r := <-done:
		return r
	case <-time.After(bound):
		t.Fatalf("the duplicate did not answer within %v", bound)
	}
	return doResult{}
}

// binaryBody is a body with every byte value.
func binaryBody() []byte {
	b := make([]byte, 256)
	for i := range b {
		b[i] = byte(i)
	}
	return b
}

func TestWaitForHolderCompletes(t *testing.T) {
	for _, ws := range waitStores(nil) {
		t.Run(ws.name, func(t *testing.T) {
			store := ws.open(t)
			holder := hold(t, store, "wf-1", time.Minute)
			g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: 30 * time.Second}
			var calls atomic.Int32
			done := doAsync(bg, g, "wf-1", okHandler(&calls))
			defer func() { _, _ = store.(Releaser).Release(bg, "wf-1", holder.Token, time.Now()) }()
			awaitWaiting(t, ws, 1, done)
			// Still waiting a moment later: the duplicate is in the wait,
			// not on its way out of it.
			time.Sleep(300 * time.Millisecond)
			if len(done) > 0 {
				r := <-done
				t.Fatalf("the duplicate answered before the holder completed: out=%s err=%v", r.out, r.err)
			}
			body := binaryBody()
			ctx := WithClaim(bg, Claim{Key: "wf-1", Token: holder.Token})
			if err := store.Complete(ctx, "wf-1", "fp", Response{Status: 201, Body: body}, time.Now(), time.Hour); err != nil {
				t.Fatalf("holder's complete: %v", err)
			}
			r := result(t, done, 30*time.Second)
			if r.out != Replayed || r.err != nil || r.resp.Status != 201 || !bytes.Equal(r.resp.Body, body) || calls.Load() != 0 {
				t.Fatalf("duplicate: out=%s err=%v status=%d body=%d bytes calls=%d", r.out, r.err, r.resp.Status, len(r.resp.Body), calls.Load())
			}
			// Well inside the 30 s wait: the completion ended it.
			if r.took > 20*time.Second {
				t.Fatalf("the duplicate answered after %v", r.took)
			}
			if n := ws.waiting(t); n != 0 {
				t.Fatalf("%d callers still wait", n)
			}
		})
	}
}

func TestWaitForHolderReleases(t *testing.T) {
	for _, ws := range waitStores(nil) {
		t.Run(ws.name, func(t *testing.T) {
			store := ws.open(t)
			holder := hold(t, store, "wf-2", time.Minute)
			g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: 30 * time.Second}
			var calls atomic.Int32
			var token int64
			done := doAsync(bg, g, "wf-2", func(ctx context.Context) (Response, error) {
				calls.Add(1)
				token, _ = TokenFromContext(ctx)
				return Response{Status: 200, Body: []byte("second")}, nil
			})
			awaitWaiting(t, ws, 1, done)
			if ok, err := store.(Releaser).Release(bg, "wf-2", holder.Token, time.Now()); err != nil || !ok {
				t.Fatalf("holder's release: %v %v", ok, err)
			}
			r := result(t, done, 30*time.Second)
			if r.out != Executed || r.err != nil || string(r.resp.Body) != "second" || calls.Load() != 1 || token <= holder.Token {
				t.Fatalf("duplicate: out=%s err=%v resp=%+v calls=%d token=%d (holder's %d)",
					r.out, r.err, r.resp, calls.Load(), token, holder.Token)
			}
			if r.took > 20*time.Second {
				t.Fatalf("the duplicate claimed after %v", r.took)
			}
			resp, out, err := g.Do(bg, "wf-2", "fp", okHandler(&calls))
			if out != Replayed || err != nil || string(resp.Body) != "second" || calls.Load() != 1 {
				t.Fatalf("after: out=%s err=%v resp=%+v calls=%d", out, err, resp, calls.Load())
			}
		})
	}
}

func TestWaitForLeaseEnds(t *testing.T) {
	for _, ws := range waitStores(nil) {
		t.Run(ws.name, func(t *testing.T) {
			store := ws.open(t)
			// A holder that stops without completing or releasing: its
			// lease of a second ends inside the duplicate's wait.
			holder := hold(t, store, "wf-3", time.Second)
			g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: 30 * time.Second}
			var calls atomic.Int32
			var token int64
			r := <-doAsync(bg, g, "wf-3", func(ctx context.Context) (Response, error) {
				calls.Add(1)
				token, _ = TokenFromContext(ctx)
				return Response{Status: 200, Body: []byte("took over")}, nil
			})
			if r.out != Executed || r.err != nil || calls.Load() != 1 || token <= holder.Token {
				t.Fatalf("duplicate: out=%s err=%v calls=%d token=%d (holder's %d) after %v",
					r.out, r.err, calls.Load(), token, holder.Token, r.took)
			}
			if r.took > 20*time.Second {
				t.Fatalf("the duplicate took over after %v", r.took)
			}
		})
	}
}

func TestWaitForRunsOut(t *testing.T) {
	const wait = 1500 * time.Millisecond
	for _, ws := range waitStores(nil) {
		t.Run(ws.name, func(t *testing.T) {
			store := ws.open(t)
			holder := hold(t, store, "wf-4", time.Minute)
			defer func() { _, _ = store.(Releaser).Release(bg, "wf-4", holder.Token, time.Now()) }()
			start := time.Now()
			rec, claimed, err := store.(Waiter).BeginWait(bg, "wf-4", "fp", time.Now(), time.Minute, time.Hour, wait)
			took := time.Since(start)
			if err != nil || claimed || rec.State != Processing || rec.Token != 0 {
				t.Fatalf("BeginWait: rec=%+v claimed=%v err=%v", rec, claimed, err)
			}
			// The answer tells when the holder's lease ends.
			if d := rec.LeaseUntil.Sub(holder.LeaseUntil); d < -time.Second || d > time.Second {
				t.Fatalf("lease_until %v, holder's %v", rec.LeaseUntil, holder.LeaseUntil)
			}
			if took < wait*9/10 || took > wait+20*time.Second {
				t.Fatalf("in flight after %v, wait %v", took, wait)
			}
			g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: wait}
			var calls atomic.Int32
			r := <-doAsync(bg, g, "wf-4", okHandler(&calls))
			if r.out != InFlight || !errors.Is(r.err, ErrInFlight) || calls.Load() != 0 || r.took < wait*9/10 {
				t.Fatalf("Do: out=%s err=%v calls=%d after %v", r.out, r.err, calls.Load(), r.took)
			}
			// Without WaitFor, in flight at once: well under the wait.
			g.WaitFor = 0
			r = <-doAsync(bg, g, "wf-4", okHandler(&calls))
			if r.out != InFlight || !errors.Is(r.err, ErrInFlight) || calls.Load() != 0 {
				t.Fatalf("Do without WaitFor: out=%s err=%v calls=%d", r.out, r.err, calls.Load())
			}
			if n := ws.waiting(t); n != 0 {
				t.Fatalf("%d callers still wait", n)
			}
		})
	}
}

func TestWaitForTwentyDuplicates(t *testing.T) {
	// Each waiting duplicate holds a connection, and the holder needs one
	// to complete: the pool has room for all of them.
	bigPool := func(t *testing.T) Store {
		pool := newPool(t, dsn()+" pool_max_conns=25", nil, false)
		s := NewPostgresStore(pool)
		s.Scope = newScope(t)
		return s
	}
	for _, ws := range waitStores(bigPool) {
		t.Run(ws.name, func(t *testing.T) {
			store := ws.open(t)
			g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: 10 * time.Second}
			var calls atomic.Int32
			h := func(context.Context) (Response, error) {
				calls.Add(1)
				time.Sleep(2 * time.Second)
				return Response{Status: 200, Body: []byte(`{"paid":true}`)}, nil
			}
			const n = 20
			results := make([]doResult, n)
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					results[i] = <-doAsync(bg, g, "wf-20", h)
				}(i)
			}
			wg.Wait()
			count := map[Outcome]int{}
			for i, r := range results {
				count[r.out]++
				if r.err != nil || r.resp.Status != 200 || string(r.resp.Body) != `{"paid":true}` {
					t.Errorf("caller %d: out=%s err=%v resp=%+v", i, r.out, r.err, r.resp)
				}
			}
			if count[Executed] != 1 || count[Replayed] != n-1 || count[InFlight] != 0 || calls.Load() != 1 {
				t.Fatalf("outcomes %v, handler calls %d: want 1 executed, %d replayed, 0 in flight", count, calls.Load(), n-1)
			}
		})
	}
}

func TestWaitForPostgres(t *testing.T) {
	t.Run("six_argument_form_unless_waiting", func(t *testing.T) {
		// A schema with only the six-argument idem_begin, as in a database
		// whose extension predates wait_for (and the recovery point's
		// phase and phase_data: the store reads the columns it finds).
		if _, err := testPool.Exec(bg, `DROP SCHEMA IF EXISTS go_idem_old CASCADE;
			CREATE SCHEMA go_idem_old;
			CREATE FUNCTION go_idem_old.idem_begin(text, text, interval, interval, text, boolean)
			RETURNS TABLE (claimed boolean, state text, token bigint, status integer, body bytea,
			               lease_until timestamptz, expires_at timestamptz)
			LANGUAGE sql AS 'SELECT claimed, state, token, status, body, lease_until, expires_at
			                 FROM public.idem_begin($1, $2, $3, $4, $5, $6)'`); err != nil {
			t.Fatal(err)
		}
		defer testPool.Exec(bg, `DROP SCHEMA go_idem_old CASCADE`)
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		store.Schema = "go_idem_old"
		rec, claimed, err := store.BeginWait(bg, "wf-old", "fp", time.Now(), time.Minute, time.Hour, 0)
		if err != nil || !claimed {
			t.Fatalf("without a wait: rec=%+v claimed=%v err=%v", rec, claimed, err)
		}
		g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour}
		var calls atomic.Int32
		if _, out, err := g.Do(bg, "wf-old", "fp", okHandler(&calls)); out != InFlight || !errors.Is(err, ErrInFlight) {
			t.Fatalf("Do without WaitFor: out=%s err=%v", out, err)
		}
		_, _, err = store.BeginWait(bg, "wf-old", "fp", time.Now(), time.Minute, time.Hour, time.Second)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "42883" {
			t.Fatalf("with a wait: %v, want 42883 (no idem_begin with wait_for)", err)
		}
	})
	t.Run("timeout_leaves_room_for_the_wait", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		store.Timeout = time.Second
		holder := hold(t, store, "wf-5", time.Minute)
		g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: 30 * time.Second}
		var calls atomic.Int32
		done := doAsync(bg, g, "wf-5", okHandler(&calls))
		defer func() { _, _ = store.Release(bg, "wf-5", holder.Token, time.Now()) }()
		ws := waitStore{waiting: serverWaiting}
		awaitWaiting(t, ws, 1, done)
		// Past Timeout, the duplicate still waits.
		time.Sleep(2 * store.Timeout)
		if len(done) > 0 {
			r := <-done
			t.Fatalf("the duplicate answered after %v, before the holder completed: out=%s err=%v", r.took, r.out, r.err)
		}
		ctx := WithClaim(bg, Claim{Key: "wf-5", Token: holder.Token})
		if err := store.Complete(ctx, "wf-5", "fp", Response{Status: 202, Body: []byte("later")}, time.Now(), time.Hour); err != nil {
			t.Fatal(err)
		}
		r := result(t, done, 30*time.Second)
		if r.out != Replayed || r.err != nil || r.resp.Status != 202 || string(r.resp.Body) != "later" || calls.Load() != 0 {
			t.Fatalf("duplicate: out=%s err=%v resp=%+v calls=%d", r.out, r.err, r.resp, calls.Load())
		}
	})
	t.Run("caller_deadline_ends_the_server_wait", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		holder := hold(t, store, "wf-6", time.Minute)
		defer func() { _, _ = store.Release(bg, "wf-6", holder.Token, time.Now()) }()
		g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: time.Minute}
		ctx, cancel := context.WithTimeout(bg, 2*time.Second)
		defer cancel()
		var calls atomic.Int32
		r := result(t, doAsync(ctx, g, "wf-6", okHandler(&calls)), 40*time.Second)
		// Cut off by the deadline: not sooner (the server waited), and
		// well before WaitFor.
		if r.out != Unavailable || !errors.Is(r.err, ErrUnavailable) || calls.Load() != 0 || r.took < 1800*time.Millisecond || r.took > 30*time.Second {
			t.Fatalf("out=%s err=%v calls=%d after %v", r.out, r.err, calls.Load(), r.took)
		}
		if !waitFor(30*time.Second, func() bool { return serverWaiting(t) == 0 }) {
			t.Fatalf("the server still waits after the caller's deadline")
		}
		if st := lookup(t, store.Scope, "wf-6"); st.state != "PROCESSING" || st.token != holder.Token {
			t.Fatalf("key: %+v, want the holder's claim %d", st, holder.Token)
		}
	})
	t.Run("no_wait_with_wait_for_refused", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		store.NoWait = true
		_, _, err := store.BeginWait(bg, "wf-7", "fp", time.Now(), time.Minute, time.Hour, time.Second)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "22023" {
			t.Fatalf("NoWait with a wait: %v, want 22023", err)
		}
		if st := lookup(t, store.Scope, "wf-7"); st.found {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("do_tx_waits_for_a_committed_claim", func(t *testing.T) {
		setupStock(t)
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		holder := hold(t, store, "wf-8", time.Minute)
		defer func() { _, _ = store.Release(bg, "wf-8", holder.Token, time.Now()) }()
		g := &Guard{Store: store, Retention: time.Hour}
		var calls atomic.Int32
		// Without WaitFor, the committed claim is in flight at once.
		if _, out, err := g.DoTx(bg, "wf-8", "fp", reserveTx("wf-8", &calls, nil)); out != InFlight || !errors.Is(err, ErrInFlight) {
			t.Fatalf("DoTx without WaitFor: out=%s err=%v", out, err)
		}
		g.WaitFor = 30 * time.Second
		done := make(chan doResult, 1)
		go func() {
			start := time.Now()
			resp, out, err := g.DoTx(bg, "wf-8", "fp", reserveTx("wf-8", &calls, nil))
			done <- doResult{resp, out, err, time.Since(start)}
		}()
		awaitWaiting(t, waitStore{waiting: serverWaiting}, 1, done)
		ctx := WithClaim(bg, Claim{Key: "wf-8", Token: holder.Token})
		if err := store.Complete(ctx, "wf-8", "fp", Response{Status: 201, Body: []byte(`{"reserved":"A"}`)}, time.Now(), time.Hour); err != nil {
			t.Fatal(err)
		}
		r := result(t, done, 30*time.Second)
		if r.out != Replayed || r.err != nil || r.resp.Status != 201 || string(r.resp.Body) != `{"reserved":"A"}` || calls.Load() != 0 {
			t.Fatalf("DoTx: out=%s err=%v resp=%+v calls=%d", r.out, r.err, r.resp, calls.Load())
		}
		if qty, res := stockState(t); qty != 10 || res != 0 {
			t.Fatalf("stock=%d reservations=%d, want untouched", qty, res)
		}
	})
}

func TestMemoryWaitForCancel(t *testing.T) {
	store := NewMemoryStore()
	holder := hold(t, store, "wf-m", time.Minute)
	g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, WaitFor: time.Minute}
	ctx, cancel := context.WithCancel(bg)
	var calls atomic.Int32
	done := doAsync(ctx, g, "wf-m", okHandler(&calls))
	awaitWaiting(t, waitStore{waiting: func(*testing.T) int { return store.memoryWaiting() }}, 1, done)
	cancel()
	r := result(t, done, 30*time.Second)
	if r.out != Unavailable || !errors.Is(r.err, ErrUnavailable) || calls.Load() != 0 || store.memoryWaiting() != 0 {
		t.Fatalf("out=%s err=%v calls=%d waiting=%d", r.out, r.err, calls.Load(), store.memoryWaiting())
	}
	// The holder's claim is untouched.
	if err := store.Complete(WithClaim(bg, Claim{Key: "wf-m", Token: holder.Token}), "wf-m", "fp", Response{Status: 200}, time.Now(), time.Hour); err != nil {
		t.Fatal(err)
	}
}
