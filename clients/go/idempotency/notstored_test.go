package idempotency

// Tests of issue #23 and #24 in the Go guard: a response the store
// refuses for good is replaced by the fixed 500 "Response not stored"; a
// call the client gave up on is ended on the server too; a missing
// function or schema is named.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// logLines is a Guard.Logf that keeps what was logged.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) logf(format string, args ...interface{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

func (l *logLines) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}

// failComplete is a Fault hook that fails the next n completes with err.
func failComplete(n int, err error) func(string) error {
	var left int32 = int32(n)
	return func(op string) error {
		if op == "complete" && atomic.AddInt32(&left, -1) >= 0 {
			return err
		}
		return nil
	}
}

func TestResponseNotStored(t *testing.T) {
	// The server refuses the handler's status (22023): the 500 is stored
	// in its place, logged with the key, and replayed; the handler ran once.
	t.Run("refused_status", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Scope = newScope(t)
		var log logLines
		g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, Logf: log.logf}
		var calls atomic.Int32
		h := func(context.Context) (Response, error) {
			calls.Add(1)
			return Response{Status: -1, Body: []byte("sent once")}, nil
		}
		resp, out, err := g.Do(bg, "ns-1", "fp", h)
		var ns *NotStoredError
		var pg *pgconn.PgError
		if out != Executed || !errors.Is(err, ErrNotStored) || !errors.As(err, &ns) || ns.Key != "ns-1" ||
			!errors.As(err, &pg) || pg.Code != "22023" || string(resp.Body) != "sent once" {
			t.Fatalf("out=%s err=%v resp=%+v", out, err, resp)
		}
		if lines := log.all(); len(lines) != 1 || !strings.Contains(lines[0], `"ns-1"`) ||
			!strings.Contains(lines[0], "not stored") {
			t.Fatalf("logged %q", lines)
		}
		if st := lookup(t, store.Scope, "ns-1"); st.state != "DONE" || st.status == nil || *st.status != 500 ||
			st.size == nil || int(*st.size) != len(NotStoredBody) {
			t.Fatalf("stored %+v", st)
		}
		for i := 0; i < 2; i++ {
			resp, out, err = g.Do(bg, "ns-1", "fp", h)
			if out != Replayed || err != nil || resp.Status != 500 || string(resp.Body) != NotStoredBody || calls.Load() != 1 {
				t.Fatalf("retry %d: out=%s err=%v resp=%d %s calls=%d", i, out, err, resp.Status, resp.Body, calls.Load())
			}
		}
	})

	// Each SQLSTATE through the fault hook, with both stores: a complete
	// that may yet succeed, or a claim that is no longer ours, leaves the
	// key in flight; any other is replaced by the 500.
	replaced := map[string]bool{
		"22023": true, "22P02": true, "54000": true, "XX000": true, "23505": true, "ID001": true,
		"40001": false, "40P01": false, "55P03": false, "57014": false, "57P01": false,
		"08006": false, "53300": false, "ID002": false, "ID003": false, "ID004": false, "42501": false,
	}
	for code, want := range replaced {
		code, want := code, want
		for _, kind := range []string{"postgres", "memory"} {
			kind := kind
			t.Run(kind+"_"+code, func(t *testing.T) {
				fault := failComplete(1, &pgconn.PgError{Code: code, Message: "injected"})
				var store Store
				var state func() (string, int)
				now := base
				if kind == "postgres" {
					s := newTestStore(t)
					s.Fault = fault
					store = s
					state = func() (string, int) {
						st := lookup(t, s.Scope, "k")
						if st.status == nil {
							return st.state, 0
						}
						return st.state, int(*st.status)
					}
				} else {
					s := NewMemoryStore()
					s.Fault = fault
					store = s
					state = func() (string, int) {
						rec, claimed, err := s.Begin(bg, "k", "fp", now, testLease, time.Hour)
						if err != nil || claimed {
							t.Fatalf("look: claimed=%v err=%v", claimed, err)
						}
						return string(rec.State), rec.Response.Status
					}
				}
				var log logLines
				g := &Guard{Store: store, Lease: testLease, Retention: time.Hour, Logf: log.logf,
					Now: func() time.Time { return now }}
				var calls atomic.Int32
				_, out, err := g.Do(bg, "k", "fp", okHandler(&calls))
				var pg *pgconn.PgError
				if out != Executed || calls.Load() != 1 || !errors.As(err, &pg) || pg.Code != code ||
					errors.Is(err, ErrNotStored) != want || (len(log.all()) == 1) != want {
					t.Fatalf("out=%s err=%v calls=%d logged=%q", out, err, calls.Load(), log.all())
				}
				st, status := state()
				if want && (st != "DONE" || status != 500) || !want && st != "PROCESSING" {
					t.Fatalf("key %s/%d", st, status)
				}
				resp, out, err := g.Do(bg, "k", "fp", okHandler(&calls))
				if want && (out != Replayed || resp.Status != 500 || string(resp.Body) != NotStoredBody) ||
					!want && (out != InFlight || !errors.Is(err, ErrInFlight)) || calls.Load() != 1 {
					t.Fatalf("retry: out=%s err=%v resp=%d calls=%d", out, err, resp.Status, calls.Load())
				}
			})
		}
	}

	// The 500 cannot be stored either: the key stays in flight, the
	// error tells both, and the log names the key.
	t.Run("replacement_fails", func(t *testing.T) {
		store := newTestStore(t)
		store.Fault = failComplete(2, &pgconn.PgError{Code: "22023", Message: "injected"})
		var log logLines
		now := base
		g := &Guard{Store: store, Lease: testLease, Retention: time.Hour, Logf: log.logf,
			Now: func() time.Time { return now }}
		var calls atomic.Int32
		_, out, err := g.Do(bg, "k2", "fp", okHandler(&calls))
		if out != Executed || err == nil || errors.Is(err, ErrNotStored) || !strings.Contains(err.Error(), "in its place failed") {
			t.Fatalf("out=%s err=%v", out, err)
		}
		if lines := log.all(); len(lines) != 1 || !strings.Contains(lines[0], `"k2"`) {
			t.Fatalf("logged %q", lines)
		}
		if st := lookup(t, store.Scope, "k2"); st.state != "PROCESSING" {
			t.Fatalf("%+v", st)
		}
	})
}

// abandonedPool is a pool of one connection, named app, that makes no
// new connection once blocked is set: a cancel request (which pgx sends
// on a new connection) then cannot reach the server, as through a proxy
// that drops it.
func abandonedPool(t *testing.T, app string, blocked *atomic.Bool) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if blocked.Load() {
			return nil, errors.New("test: no new connections")
		}
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	pool, err := pgxpool.ConnectConfig(bg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := pool.Ping(bg); err != nil {
		t.Fatal(err)
	}
	return pool
}

// busyBackends counts the server processes of application app that are
// not idle outside a transaction.
func busyBackends(t *testing.T, app string) int {
	var n int
	if err := testPool.QueryRow(bg, `SELECT count(*)::integer FROM pg_catalog.pg_stat_activity
		WHERE application_name = $1 AND state IS DISTINCT FROM 'idle'`, app).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// activity describes the server processes of application app.
func activity(t *testing.T, app string) string {
	var s string
	if err := testPool.QueryRow(bg, `SELECT coalesce(string_agg(format('%s/%s/%s: %s', state, wait_event_type,
		wait_event, query), '; '), 'none') FROM pg_catalog.pg_stat_activity WHERE application_name = $1`,
		app).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestDeadlineEndsServerWait(t *testing.T) {
	t.Run("Do", func(t *testing.T) { abandonedCase(t, false) })
	t.Run("DoTx", func(t *testing.T) { abandonedCase(t, true) })
}

// abandonedCase: a holder keeps the key in an open transaction; a call
// with a deadline waits for it, and its cancel cannot reach the server.
// The server ends the call by the deadline on its own, and once the
// holder rolls back, the key is free for the next claimant at once.
func abandonedCase(t *testing.T, tx bool) {
	var blocked atomic.Bool
	app := fmt.Sprintf("idem-abandoned-%d", atomic.AddInt64(&scopeSeq, 1))
	pool := abandonedPool(t, app, &blocked)
	store := NewPostgresStore(pool)
	store.Scope = newScope(t)
	holder, err := testPool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(bg)
	var claimed bool
	if err := holder.QueryRow(bg, `SELECT claimed FROM public.idem_begin($1::text, $2::text, NULL::interval,
		NULL::interval, $3::text, true)`, "ab-1", "fp", store.Scope).Scan(&claimed); err != nil || !claimed {
		t.Fatalf("holder claim: %v %v", claimed, err)
	}
	blocked.Store(true)
	g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour}
	var calls atomic.Int32
	ctx, cancel := context.WithTimeout(bg, 500*time.Millisecond)
	defer cancel()
	var out Outcome
	if tx {
		_, out, err = g.DoTx(ctx, "ab-1", "fp", func(context.Context, pgx.Tx) (Response, error) {
			calls.Add(1)
			return Response{Status: 200}, nil
		})
	} else {
		_, out, err = g.Do(ctx, "ab-1", "fp", okHandler(&calls))
	}
	if out != Unavailable || !errors.Is(err, ErrUnavailable) || calls.Load() != 0 {
		t.Fatalf("out=%s err=%v calls=%d", out, err, calls.Load())
	}
	// The abandoned call's wait ends while the holder still holds the key:
	// nothing but the server's own timeout can end it.  Its backend then
	// exits (the client closed the connection when ctx ended the read) or,
	// when the server's error came first or ctx ended between two
	// statements, is idle in the pool after the rollback: never waiting,
	// never in a transaction.
	if !waitFor(30*time.Second, func() bool { return busyBackends(t, app) == 0 }) {
		t.Fatalf("the abandoned call still waits on the server: %s", activity(t, app))
	}
	if err := holder.Rollback(bg); err != nil {
		t.Fatal(err)
	}
	next := NewPostgresStore(testPool)
	next.Scope = store.Scope
	next.NoWait = true
	rec, claimed, err := next.Begin(bg, "ab-1", "fp", time.Now(), time.Minute, time.Hour)
	if err != nil || !claimed {
		t.Fatalf("next claimant: rec=%+v claimed=%v err=%v", rec, claimed, err)
	}
	if st := lookup(t, store.Scope, "ab-1"); st.state != "PROCESSING" || st.token != rec.Token {
		t.Fatalf("key %+v, want the next claimant's token %d", st, rec.Token)
	}
}

// A session's own lock_timeout shorter than the deadline still ends the
// wait: the deadline never loosens it.
func TestSessionTimeoutKept(t *testing.T) {
	pool := newPool(t, dsn(), map[string]string{"lock_timeout": "200ms"}, false)
	store := NewPostgresStore(pool)
	store.Scope = newScope(t)
	holder, err := testPool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(bg)
	var claimed bool
	if err := holder.QueryRow(bg, `SELECT claimed FROM public.idem_begin($1::text, $2::text, NULL::interval,
		NULL::interval, $3::text, true)`, "lt-1", "fp", store.Scope).Scan(&claimed); err != nil || !claimed {
		t.Fatalf("holder claim: %v %v", claimed, err)
	}
	ctx, cancel := context.WithTimeout(bg, time.Hour)
	defer cancel()
	_, _, err = store.Begin(ctx, "lt-1", "fp", time.Now(), time.Minute, time.Hour)
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "55P03" {
		t.Fatalf("begin: %v, want the session's lock_timeout (55P03)", err)
	}
}

// DoTx bounds its claim's wait, then gives the handler the transaction's
// own settings back.
func TestDoTxKeepsTimeouts(t *testing.T) {
	// Longer than the deadline: the claim runs under the deadline's.
	pool := newPool(t, dsn(), map[string]string{"statement_timeout": "2h", "lock_timeout": "3h"}, false)
	store := NewPostgresStore(pool)
	store.Scope = newScope(t)
	g := &Guard{Store: store}
	ctx, cancel := context.WithTimeout(bg, time.Hour)
	defer cancel()
	var settings string
	_, out, err := g.DoTx(ctx, "tt-1", "fp", func(ctx context.Context, tx pgx.Tx) (Response, error) {
		err := tx.QueryRow(ctx, "SELECT current_setting('statement_timeout') || '/' || current_setting('lock_timeout')").Scan(&settings)
		return Response{Status: 200}, err
	})
	if out != Executed || err != nil || settings != "2h/3h" {
		t.Fatalf("out=%s err=%v settings=%q", out, err, settings)
	}
	// A transaction of Do's own, for comparison, runs under the deadline's.
	var during string
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(bg)
	if err := store.setLocals(ctx, tx, time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, "SELECT current_setting('statement_timeout') || '/' || current_setting('lock_timeout')").Scan(&during); err != nil {
		t.Fatal(err)
	}
	if parts := strings.Split(during, "/"); len(parts) != 2 || parts[0] != parts[1] || !strings.HasSuffix(parts[0], "ms") {
		t.Fatalf("settings under a deadline of an hour: %q", during)
	}
}

func TestMissingFunctionNamed(t *testing.T) {
	for _, c := range []struct {
		schema, code, quoted string
		wait                 time.Duration
	}{
		{"no_such_schema", "3F000", "no_such_schema", 0},
		{"pg_catalog", "42883", "pg_catalog", 0},
		{"pg_catalog", "42883", "pg_catalog", time.Second},
	} {
		// Timeout gives every call a deadline: the settings then go in one
		// batch with the call's statement.
		for _, timeout := range []time.Duration{0, time.Minute} {
			store := NewPostgresStore(testPool)
			store.Scope = newScope(t)
			store.Schema = c.schema
			store.Timeout = timeout
			_, _, err := store.BeginWait(bg, "m-1", "fp", time.Now(), time.Second, time.Hour, c.wait)
			var ie *Error
			var pg *pgconn.PgError
			fn, beginName := fnBegin, "idem_begin"
			if c.wait > 0 {
				fn, beginName = fnBeginWait, "idem_begin with wait_for"
			}
			msg := fmt.Sprint(err)
			if !errors.As(err, &ie) || ie.Code != c.code || !errors.As(err, &pg) || pg.Code != c.code ||
				!strings.Contains(msg, `"`+c.quoted+`".`+fn) ||
				!strings.HasPrefix(ie.Message, beginName+` not found in schema "`+c.quoted+`" (`+c.code+": ") ||
				!strings.HasSuffix(ie.Message, "; set PostgresStore.Schema to the schema where CREATE EXTENSION idem put it, "+
					"or if the version is old run ALTER EXTENSION idem UPDATE") {
				t.Fatalf("schema %s wait %v timeout %v: %v", c.schema, c.wait, timeout, err)
			}
			err = store.Complete(WithClaim(bg, Claim{Key: "m-1", Token: 1}), "m-1", "fp", Response{Status: 200}, time.Now(), time.Hour)
			if !errors.As(err, &ie) || ie.Code != c.code || !strings.Contains(err.Error(), fnComplete) {
				t.Fatalf("complete, schema %s: %v", c.schema, err)
			}
			_, err = store.Release(bg, "m-1", 1, time.Now())
			if !errors.As(err, &ie) || !strings.Contains(err.Error(), fnRelease) {
				t.Fatalf("release, schema %s: %v", c.schema, err)
			}
			_, err = store.Extend(bg, "m-1", 1, time.Now(), time.Second)
			if !errors.As(err, &ie) || !strings.Contains(err.Error(), fnExtend) {
				t.Fatalf("extend, schema %s: %v", c.schema, err)
			}
			// Do tells it through ErrUnavailable.
			g := &Guard{Store: store, WaitFor: c.wait}
			var calls atomic.Int32
			_, out, err := g.Do(bg, "m-1", "fp", okHandler(&calls))
			if out != Unavailable || !errors.Is(err, ErrUnavailable) || !errors.As(err, &ie) || ie.Code != c.code ||
				!strings.Contains(err.Error(), fn) || calls.Load() != 0 {
				t.Fatalf("Do, schema %s: out=%s err=%v", c.schema, out, err)
			}
		}
	}
}
