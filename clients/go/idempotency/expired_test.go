package idempotency

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v4"
)

// EXPIRED (issue #44, item 4): a server with tombstones answers a retry
// whose response's retention is over, but whose key idem_begin's remember
// still keeps, with the state EXPIRED.  Played by a look-alike idem_begin
// in its own schema that answers EXPIRED (status 201, no body, no token)
// and records each call's remember; a second look-alike without remember
// (seven parameters) plays a server before tombstones.
func expiredSchemas(t *testing.T) (string, string) {
	bg := context.Background()
	s := fmt.Sprintf("idem_expired_go_%d", os.Getpid())
	f := fmt.Sprintf("idem_future7_go_%d", os.Getpid())
	if _, err := testPool.Exec(bg, fmt.Sprintf(`DROP SCHEMA IF EXISTS %[1]s CASCADE; DROP SCHEMA IF EXISTS %[2]s CASCADE;
		CREATE SCHEMA %[1]s;
		CREATE TABLE %[1]s.calls (id bigserial PRIMARY KEY, key text, remember interval);
		CREATE FUNCTION %[1]s.idem_begin(key text, fingerprint text, lease interval DEFAULT NULL,
			retention interval DEFAULT NULL, scope text DEFAULT '', wait boolean DEFAULT true,
			wait_for interval DEFAULT NULL, remember interval DEFAULT NULL)
		RETURNS SETOF idem.begin_result LANGUAGE plpgsql AS $$ BEGIN
			INSERT INTO %[1]s.calls (key, remember) VALUES (idem_begin.key, idem_begin.remember);
			RETURN QUERY SELECT false, 'EXPIRED'::text, NULL::bigint, 201, NULL::bytea, NULL::timestamptz,
				now() + interval '1 day', NULL::text, NULL::bytea;
		END $$;
		CREATE SCHEMA %[2]s;
		CREATE FUNCTION %[2]s.idem_begin(text, text, interval DEFAULT NULL, interval DEFAULT NULL,
			text DEFAULT '', boolean DEFAULT true, interval DEFAULT NULL)
		RETURNS SETOF idem.begin_result LANGUAGE sql AS $$ SELECT false, 'TOMBSTONED', NULL::bigint, 200,
			NULL::bytea, NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::bytea $$`, s, f)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		testPool.Exec(context.Background(), fmt.Sprintf("DROP SCHEMA %s CASCADE; DROP SCHEMA %s CASCADE", s, f))
	})
	return s, f
}

// remembered is the remember of each recorded call for key, in ms (-1: not sent).
func remembered(t *testing.T, schema, key string) []int64 {
	rows, err := testPool.Query(context.Background(), fmt.Sprintf(
		"SELECT coalesce((extract(epoch FROM remember) * 1000)::int8, -1) FROM %s.calls WHERE key = $1 ORDER BY id", schema), key)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var ms int64
		if err := rows.Scan(&ms); err != nil {
			t.Fatal(err)
		}
		out = append(out, ms)
	}
	return out
}

func TestExpired(t *testing.T) {
	bg := context.Background()
	schema, future := expiredSchemas(t)
	t.Run("do", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Schema = schema
		g := &Guard{Store: store}
		var calls atomic.Int32
		resp, out, err := g.Do(bg, "exp-do", "fp", okHandler(&calls))
		if out != Expired || !errors.Is(err, ErrExpired) || resp.Status != 201 || resp.Body != nil || calls.Load() != 0 {
			t.Fatalf("out=%s err=%v resp=%+v calls=%d", out, err, resp, calls.Load())
		}
		if string(Expired) != "EXPIRED" {
			t.Fatal(Expired)
		}
		if got := remembered(t, schema, "exp-do"); len(got) != 1 || got[0] != -1 {
			t.Fatalf("remember sent unset: %v", got)
		}
	})
	t.Run("remember", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Schema = schema
		store.Remember = 90 * time.Minute
		g := &Guard{Store: store}
		var calls atomic.Int32
		if _, out, _ := g.Do(bg, "exp-rem", "fp", okHandler(&calls)); out != Expired {
			t.Fatal(out)
		}
		g.WaitFor = time.Second // the form with wait_for, remember after it
		if _, out, _ := g.Do(bg, "exp-rem-wait", "fp", okHandler(&calls)); out != Expired {
			t.Fatal(out)
		}
		if got := remembered(t, schema, "exp-rem"); len(got) != 1 || got[0] != 5400000 {
			t.Fatalf("%v", got)
		}
		if got := remembered(t, schema, "exp-rem-wait"); len(got) != 1 || got[0] != 5400000 {
			t.Fatalf("%v", got)
		}
		if calls.Load() != 0 {
			t.Fatal(calls.Load())
		}
	})
	t.Run("dotx", func(t *testing.T) {
		store := NewPostgresStore(testPool)
		store.Schema = schema
		store.Remember = time.Minute
		g := &Guard{Store: store}
		ran := 0
		resp, out, err := g.DoTx(bg, "exp-tx", "fp", func(ctx context.Context, tx pgx.Tx) (Response, error) {
			ran++
			return Response{Status: 200}, nil
		})
		if out != Expired || !errors.Is(err, ErrExpired) || resp.Status != 201 || resp.Body != nil || ran != 0 {
			t.Fatalf("out=%s err=%v resp=%+v ran=%d", out, err, resp, ran)
		}
	})
	t.Run("remember_only_when_set", func(t *testing.T) {
		// A server without remember serves a store that leaves it 0 (the
		// look-alike's unknown state shows the call reached it); one with
		// Remember set names an argument that server lacks (42883).
		store := NewPostgresStore(testPool)
		store.Schema = future
		g := &Guard{Store: store}
		var calls atomic.Int32
		if _, out, err := g.Do(bg, "exp-old", "fp", okHandler(&calls)); out != Unavailable ||
			!strings.Contains(fmt.Sprint(err), `unknown state "TOMBSTONED"`) {
			t.Fatalf("out=%s err=%v", out, err)
		}
		store.Remember = time.Minute
		_, out, err := g.Do(bg, "exp-old-rem", "fp", okHandler(&calls))
		var ie *Error
		if out != Unavailable || !errors.As(err, &ie) || ie.Code != "42883" || calls.Load() != 0 {
			t.Fatalf("out=%s err=%v", out, err)
		}
		plain := NewPostgresStore(testPool)
		for _, w := range []time.Duration{0, time.Second} {
			sql, _, args := plain.beginCall("k", "f", 0, 0, w)
			if strings.Contains(sql, "remember") {
				t.Fatal(sql)
			}
			plain.Remember = time.Minute
			sql2, _, args2 := plain.beginCall("k", "f", 0, 0, w)
			want := fmt.Sprintf(", remember => $%d::interval)", len(args)+1)
			if !strings.HasSuffix(sql2, want) || len(args2) != len(args)+1 {
				t.Fatalf("%q %d", sql2, len(args2))
			}
			plain.Remember = 0
		}
	})
}

// TestServerTombstone runs against the server's own tombstones (extension
// 1.6), not a look-alike: a key completed with a retention of 1 s and
// Remember 1 hour, retried once its retention is over (expires_at < now(),
// polled), is Expired with the stored status and the handler does not run
// again; the same without Remember runs the handler again.
func TestServerTombstone(t *testing.T) {
	bg := context.Background()
	scope := newScope(t)
	kept := NewPostgresStore(testPool)
	kept.Scope = scope
	kept.Remember = time.Hour
	plain := NewPostgresStore(testPool)
	plain.Scope = scope
	gk := &Guard{Store: kept, Lease: time.Second, Retention: time.Second}
	gp := &Guard{Store: plain, Lease: time.Second, Retention: time.Second}
	var keptCalls, plainCalls atomic.Int32
	if _, out, err := gk.Do(bg, "tomb-kept", "fp", okHandler(&keptCalls)); out != Executed || err != nil {
		t.Fatalf("first: out=%s err=%v", out, err)
	}
	if _, out, err := gp.Do(bg, "tomb-plain", "fp", okHandler(&plainCalls)); out != Executed || err != nil {
		t.Fatalf("first without remember: out=%s err=%v", out, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var over bool
		if err := testPool.QueryRow(bg, `SELECT coalesce(bool_and(expires_at < now()), false)
			FROM public.idem_keys WHERE scope = $1`, scope).Scan(&over); err != nil {
			t.Fatal(err)
		}
		if over {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the retention is not over after 30 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	for i := 0; i < 2; i++ {
		resp, out, err := gk.Do(bg, "tomb-kept", "fp", okHandler(&keptCalls))
		if out != Expired || !errors.Is(err, ErrExpired) || resp.Status != 200 || resp.Body != nil {
			t.Fatalf("retry %d: out=%s err=%v resp=%+v", i, out, err, resp)
		}
	}
	ran := 0
	resp, out, err := gk.DoTx(bg, "tomb-kept", "fp", func(ctx context.Context, tx pgx.Tx) (Response, error) {
		ran++
		return Response{Status: 201}, nil
	})
	if out != Expired || !errors.Is(err, ErrExpired) || resp.Status != 200 || ran != 0 {
		t.Fatalf("DoTx: out=%s err=%v resp=%+v ran=%d", out, err, resp, ran)
	}
	if keptCalls.Load() != 1 {
		t.Fatalf("the handler ran %d times, want 1", keptCalls.Load())
	}
	if _, out, _ := gp.Do(bg, "tomb-plain", "fp", okHandler(&plainCalls)); out != Executed || plainCalls.Load() != 2 {
		t.Fatalf("without remember: out=%s calls=%d, want Executed and 2", out, plainCalls.Load())
	}
	var state string
	var status int
	if err := testPool.QueryRow(bg, "SELECT state, status FROM public.idem_lookup('tomb-kept', $1)", scope).
		Scan(&state, &status); err != nil || state != "EXPIRED" || status != 200 {
		t.Fatalf("lookup: %s %d %v", state, status, err)
	}
}
