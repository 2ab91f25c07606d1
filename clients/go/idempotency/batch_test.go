package idempotency

// Round trips of DoTx and Do under a deadline: the transaction's timeouts
// are saved, bounded and the claim made in one batch.

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// writeCounter counts the messages a connection sends: pgx writes each
// request (a simple query, an extended query with its Sync, a batch) in
// one Write and then reads its answer, so every Write is a round trip.
type writeCounter struct {
	net.Conn
	writes *atomic.Int64
}

func (c writeCounter) Write(b []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(b)
}

// countedPool is a one-connection pool whose writes are counted, with the
// session's statement_timeout 2h.
func countedPool(t *testing.T, simple bool) (*pgxpool.Pool, *atomic.Int64) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn())
	if err != nil {
		t.Fatal(err)
	}
	writes := &atomic.Int64{}
	cfg.MaxConns = 1
	cfg.ConnConfig.PreferSimpleProtocol = simple
	cfg.ConnConfig.RuntimeParams["statement_timeout"] = "2h"
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return writeCounter{Conn: conn, writes: writes}, nil
	}
	pool, err := pgxpool.ConnectConfig(bg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, writes
}

func TestBoundedClaimRoundTrips(t *testing.T) {
	for _, c := range []struct {
		name   string
		simple bool
		// round trips with a deadline: DoTx's new key (its handler runs
		// one statement), DoTx's replay, Do's new key
		newKey, replay, do int64
	}{
		// A batch (BEGIN, save, bound, claim, restore), the handler's
		// statement, a batch (complete, COMMIT); a replay the batch and
		// ROLLBACK; Do's claim one batch (bound, claim) and its complete
		// one (bound, complete), each an implicit transaction.
		{"extended", false, 3, 2, 2},
		// One statement at a time: BEGIN, save, bound, claim and restore
		// are five, complete and COMMIT two; Do's BEGIN, bound, claim and
		// COMMIT four, and its complete as many.
		{"simple_protocol", true, 8, 6, 8},
	} {
		t.Run(c.name, func(t *testing.T) {
			pool, writes := countedPool(t, c.simple)
			store := NewPostgresStore(pool)
			store.Scope = newScope(t)
			g := &Guard{Store: store}
			var setting string
			var calls atomic.Int32
			handler := func(ctx context.Context, tx pgx.Tx) (Response, error) {
				calls.Add(1)
				err := tx.QueryRow(ctx, "SELECT pg_catalog.current_setting('statement_timeout')", extended).Scan(&setting)
				return Response{Status: 201, Body: []byte("once")}, err
			}
			ctx, cancel := context.WithTimeout(bg, time.Hour)
			defer cancel()
			// The connection prepares the statements on first use.
			if _, out, err := g.DoTx(ctx, "rt-warm", "fp", handler); out != Executed || err != nil {
				t.Fatalf("warm-up: out=%s err=%v", out, err)
			}
			if _, out, err := g.Do(ctx, "rt-warm-do", "fp", okHandler(&calls)); out != Executed || err != nil {
				t.Fatalf("warm-up Do: out=%s err=%v", out, err)
			}
			setting = ""
			writes.Store(0)
			_, out, err := g.DoTx(ctx, "rt-1", "fp", handler)
			if n := writes.Load(); out != Executed || err != nil || n != c.newKey {
				t.Fatalf("new key: out=%s err=%v round trips=%d, want %d", out, err, n, c.newKey)
			}
			// The handler ran under the session's statement_timeout, not
			// the claim's bound.
			if setting != "2h" {
				t.Fatalf("the handler's statement_timeout %q, want 2h", setting)
			}
			writes.Store(0)
			resp, out, err := g.DoTx(ctx, "rt-1", "fp", handler)
			if n := writes.Load(); out != Replayed || err != nil || string(resp.Body) != "once" || n != c.replay {
				t.Fatalf("replay: out=%s err=%v body=%q round trips=%d, want %d", out, err, resp.Body, n, c.replay)
			}
			writes.Store(0)
			_, out, err = g.Do(ctx, "rt-2", "fp", okHandler(&calls))
			if n := writes.Load(); out != Executed || err != nil || n != c.do {
				t.Fatalf("Do: out=%s err=%v round trips=%d, want %d", out, err, n, c.do)
			}
			// The warm-ups', the new key's and Do's; not the replay's.
			if calls.Load() != 4 {
				t.Fatalf("handlers ran %d times, want 4", calls.Load())
			}
			if st := lookup(t, store.Scope, "rt-2"); st.state != "DONE" || *st.status != 200 {
				t.Fatalf("rt-2: %+v", st)
			}
		})
	}
}
