package idempotency

// DoTx's retries (Guard.TxRetries): a transaction that fails with 40001 or
// 40P01 runs again, claim included; any other error surfaces at once.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

// setupRetryOrders makes the table of the retry tests' business rows.
func setupRetryOrders(t *testing.T) {
	t.Helper()
	if _, err := testPool.Exec(bg, `CREATE TABLE IF NOT EXISTS go_retry_orders (key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
}

func retryOrders(t *testing.T, key string) int {
	t.Helper()
	var n int
	if err := testPool.QueryRow(bg, `SELECT count(*)::integer FROM go_retry_orders WHERE key = $1`, key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// raiseSQL fails the statement, and so the transaction, with SQLSTATE code.
func raiseSQL(code string) string {
	return fmt.Sprintf(`DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '%s'; END$$`, code)
}

// failingTx is a DoTx handler that writes an order row for key, then in its
// first failures calls fails: with SQLSTATE code raised on tx, or with a
// plain Go error when code is "".  It counts its calls and keeps the token
// of each.
type failingTx struct {
	key      string
	code     string
	failures int32
	calls    atomic.Int32
	tokens   []int64
}

func (f *failingTx) run(ctx context.Context, tx pgx.Tx) (Response, error) {
	n := f.calls.Add(1)
	token, _ := TokenFromContext(ctx)
	f.tokens = append(f.tokens, token)
	if _, err := tx.Exec(ctx, `INSERT INTO go_retry_orders VALUES ($1)`, f.key); err != nil {
		return Response{}, err
	}
	if n <= f.failures {
		if f.code == "" {
			return Response{Status: 500}, errors.New("card declined")
		}
		_, err := tx.Exec(ctx, raiseSQL(f.code))
		if err == nil {
			err = errors.New("the DO block did not fail")
		}
		return Response{Status: 500}, fmt.Errorf("order %s: %w", f.key, err)
	}
	return Response{Status: 201, Body: []byte(`{"order":"` + f.key + `"}`)}, nil
}

func sqlstate(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	return ""
}

func TestDoTxRetries(t *testing.T) {
	setupRetryOrders(t)
	for _, code := range []string{"40001", "40P01"} {
		code := code
		t.Run(code+"_then_commit", func(t *testing.T) {
			store := newTestStore(t)
			g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }, TxRetries: 3}
			key := "retry-" + code
			h := &failingTx{key: key, code: code, failures: 1}
			resp, out, err := g.DoTx(bg, key, "fp", h.run)
			if out != Executed || err != nil || resp.Status != 201 || h.calls.Load() != 2 {
				t.Fatalf("out=%s err=%v resp=%+v attempts=%d", out, err, resp, h.calls.Load())
			}
			if n := retryOrders(t, key); n != 1 {
				t.Fatalf("%d order rows, want 1 (the first attempt's rolled back)", n)
			}
			// The second attempt claimed the key again: the first claim was
			// rolled back with its transaction, and its token is not the key's.
			st := lookup(t, store.Scope, key)
			if st.state != "DONE" || *st.status != 201 || len(h.tokens) != 2 || h.tokens[1] <= h.tokens[0] || st.token != h.tokens[1] {
				t.Fatalf("key %+v, tokens %v", st, h.tokens)
			}
			resp, out, err = g.DoTx(bg, key, "fp", h.run)
			if out != Replayed || err != nil || string(resp.Body) != `{"order":"`+key+`"}` || h.calls.Load() != 2 {
				t.Fatalf("replay: out=%s err=%v resp=%+v attempts=%d", out, err, resp, h.calls.Load())
			}
		})
	}
	t.Run("off_by_default", func(t *testing.T) {
		store := newTestStore(t)
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }}
		h := &failingTx{key: "retry-off", code: "40001", failures: 1}
		_, out, err := g.DoTx(bg, "retry-off", "fp", h.run)
		if out != Executed || sqlstate(err) != "40001" || h.calls.Load() != 1 {
			t.Fatalf("out=%s err=%v attempts=%d", out, err, h.calls.Load())
		}
		if n := retryOrders(t, "retry-off"); n != 0 {
			t.Fatalf("%d order rows after the rollback", n)
		}
		if st := lookup(t, store.Scope, "retry-off"); st.found {
			t.Fatalf("the claim survived the rollback: %+v", st)
		}
		// The key is free: the caller's own retry claims it.
		if _, out, err := g.DoTx(bg, "retry-off", "fp", h.run); out != Executed || err != nil || h.calls.Load() != 2 {
			t.Fatalf("caller's retry: out=%s err=%v attempts=%d", out, err, h.calls.Load())
		}
	})
	t.Run("exhausted", func(t *testing.T) {
		store := newTestStore(t)
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }, TxRetries: 2}
		h := &failingTx{key: "retry-exhausted", code: "40P01", failures: 100}
		_, out, err := g.DoTx(bg, "retry-exhausted", "fp", h.run)
		if out != Executed || sqlstate(err) != "40P01" || h.calls.Load() != 3 {
			t.Fatalf("out=%s err=%v attempts=%d, want 3", out, err, h.calls.Load())
		}
		if n := retryOrders(t, "retry-exhausted"); n != 0 {
			t.Fatalf("%d order rows", n)
		}
		if st := lookup(t, store.Scope, "retry-exhausted"); st.found {
			t.Fatalf("%+v", st)
		}
	})
	for _, code := range []string{"23505", ""} {
		code := code
		name := "not_retried_" + code
		if code == "" {
			name = "not_retried_plain_error"
		}
		t.Run(name, func(t *testing.T) {
			store := newTestStore(t)
			g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }, TxRetries: 3}
			key := "retry-" + name
			h := &failingTx{key: key, code: code, failures: 1}
			_, out, err := g.DoTx(bg, key, "fp", h.run)
			if out != Executed || err == nil || sqlstate(err) != code || h.calls.Load() != 1 {
				t.Fatalf("out=%s err=%v attempts=%d, want 1", out, err, h.calls.Load())
			}
			if n := retryOrders(t, key); n != 0 {
				t.Fatalf("%d order rows", n)
			}
			if st := lookup(t, store.Scope, key); st.found {
				t.Fatalf("%+v", st)
			}
		})
	}
	t.Run("commit_40001", func(t *testing.T) {
		// A deferred constraint trigger fails the first COMMIT with 40001:
		// the server rolled it back, so the transaction runs again.
		if _, err := testPool.Exec(bg, `DROP TABLE IF EXISTS go_retry_commit;
			DROP SEQUENCE IF EXISTS go_retry_commit_seq;
			CREATE SEQUENCE go_retry_commit_seq;
			CREATE TABLE go_retry_commit (key text NOT NULL);
			CREATE OR REPLACE FUNCTION go_retry_commit_fail() RETURNS trigger LANGUAGE plpgsql AS
			$$BEGIN
				IF nextval('go_retry_commit_seq') = 1 THEN
					RAISE EXCEPTION 'serialization failure at commit' USING ERRCODE = '40001';
				END IF;
				RETURN NULL;
			END$$;
			CREATE CONSTRAINT TRIGGER fail_first_commit AFTER INSERT ON go_retry_commit
				DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION go_retry_commit_fail()`); err != nil {
			t.Fatal(err)
		}
		store := newTestStore(t)
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }, TxRetries: 1}
		var calls atomic.Int32
		resp, out, err := g.DoTx(bg, "retry-commit", "fp", func(ctx context.Context, tx pgx.Tx) (Response, error) {
			calls.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO go_retry_commit VALUES ('retry-commit')`); err != nil {
				return Response{}, err
			}
			return Response{Status: 201, Body: []byte("committed")}, nil
		})
		if out != Executed || err != nil || resp.Status != 201 || calls.Load() != 2 {
			t.Fatalf("out=%s err=%v attempts=%d", out, err, calls.Load())
		}
		var rows int
		if err := testPool.QueryRow(bg, `SELECT count(*)::integer FROM go_retry_commit`).Scan(&rows); err != nil || rows != 1 {
			t.Fatalf("%d rows (%v), want 1", rows, err)
		}
		if st := lookup(t, store.Scope, "retry-commit"); st.state != "DONE" {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("context_done_stops", func(t *testing.T) {
		store := newTestStore(t)
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }, TxRetries: 5}
		ctx, cancel := context.WithCancel(bg)
		defer cancel()
		h := &failingTx{key: "retry-ctx", code: "40001", failures: 100}
		_, out, err := g.DoTx(ctx, "retry-ctx", "fp", func(hctx context.Context, tx pgx.Tx) (Response, error) {
			resp, err := h.run(hctx, tx)
			cancel() // the caller gives up during the first attempt
			return resp, err
		})
		if out != Executed || sqlstate(err) != "40001" || h.calls.Load() != 1 {
			t.Fatalf("out=%s err=%v attempts=%d, want 1", out, err, h.calls.Load())
		}
		if st := lookup(t, store.Scope, "retry-ctx"); st.found {
			t.Fatalf("%+v", st)
		}
	})
	t.Run("serializable_write_skew", func(t *testing.T) {
		// Two SERIALIZABLE transactions each read that two are on call and
		// take one off: PostgreSQL fails one (40001), whose retry reads one
		// left and refuses.
		if _, err := testPool.Exec(bg, `DROP TABLE IF EXISTS go_oncall;
			CREATE TABLE go_oncall (name text PRIMARY KEY, on_call boolean NOT NULL);
			INSERT INTO go_oncall VALUES ('a', true), ('b', true)`); err != nil {
			t.Fatal(err)
		}
		pool := newPool(t, dsn(), map[string]string{"default_transaction_isolation": "serializable"}, false)
		store := NewPostgresStore(pool)
		store.ClientClock = true
		store.Scope = newScope(t)
		g := &Guard{Store: store, Retention: time.Hour, Now: func() time.Time { return base }, TxRetries: 5}
		var calls atomic.Int32
		var read sync.WaitGroup
		read.Add(2)
		bothRead := make(chan struct{})
		go func() { read.Wait(); close(bothRead) }()
		offCall := func(name string) func(context.Context, pgx.Tx) (Response, error) {
			var first sync.Once
			return func(ctx context.Context, tx pgx.Tx) (Response, error) {
				calls.Add(1)
				var on int
				if err := tx.QueryRow(ctx, `SELECT count(*)::integer FROM go_oncall WHERE on_call`).Scan(&on); err != nil {
					return Response{}, err
				}
				// The first attempts both read before either writes.
				first.Do(func() {
					read.Done()
					select {
					case <-bothRead:
					case <-time.After(30 * time.Second):
					}
				})
				if on < 2 {
					return Response{Status: 409, Body: []byte("last on call")}, nil
				}
				if _, err := tx.Exec(ctx, `UPDATE go_oncall SET on_call = false WHERE name = $1`, name); err != nil {
					return Response{}, err
				}
				return Response{Status: 200, Body: []byte("off call")}, nil
			}
		}
		var wg sync.WaitGroup
		statuses := make([]int, 2)
		errs := make([]error, 2)
		for i, name := range []string{"a", "b"} {
			wg.Add(1)
			go func(i int, name string) {
				defer wg.Done()
				var resp Response
				resp, _, errs[i] = g.DoTx(bg, "off-"+name, "fp", offCall(name))
				statuses[i] = resp.Status
			}(i, name)
		}
		wg.Wait()
		var on int
		if err := testPool.QueryRow(bg, `SELECT count(*)::integer FROM go_oncall WHERE on_call`).Scan(&on); err != nil {
			t.Fatal(err)
		}
		if errs[0] != nil || errs[1] != nil || statuses[0]+statuses[1] != 200+409 || on != 1 || calls.Load() < 3 {
			t.Fatalf("errors %v, statuses %v, %d on call, %d attempts", errs, statuses, on, calls.Load())
		}
		for _, name := range []string{"a", "b"} {
			if st := lookup(t, store.Scope, "off-"+name); st.state != "DONE" {
				t.Fatalf("off-%s: %+v", name, st)
			}
		}
	})
}
