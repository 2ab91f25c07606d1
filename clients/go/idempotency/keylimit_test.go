package idempotency

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

// TestKeyLongerThanServerLimit holds the README's word on a key or scope
// longer than the server's idem.max_key_length (issue #43): Do and DoTx
// answer Unavailable with an error that wraps the server's 22001, which an
// HTTP handler answers 400 as a malformed key rather than 503; the
// handler does not run and nothing is claimed.  The limit is lowered to 16
// bytes on this test's pool only (the tests connect as a superuser).
func TestKeyLongerThanServerLimit(t *testing.T) {
	const limit = 16
	pool := newPool(t, os.Getenv("IDEM_TEST_DSN"), map[string]string{"idem.max_key_length": fmt.Sprint(limit)}, false)
	unique := func(n int) string { // n bytes, unique to this run
		s := fmt.Sprintf("k%d", time.Now().UnixNano())
		return (s + strings.Repeat("x", n))[:n]
	}
	calls := map[string]func(g *Guard, key string, ran *int) (Outcome, error){
		"Do": func(g *Guard, key string, ran *int) (Outcome, error) {
			_, out, err := g.Do(bg, key, "fp", func(context.Context) (Response, error) {
				*ran++
				return Response{Status: 201}, nil
			})
			return out, err
		},
		"DoTx": func(g *Guard, key string, ran *int) (Outcome, error) {
			_, out, err := g.DoTx(bg, key, "fp", func(context.Context, pgx.Tx) (Response, error) {
				*ran++
				return Response{Status: 201}, nil
			})
			return out, err
		},
	}
	for name, call := range calls {
		for _, what := range []string{"key", "scope"} {
			t.Run(name+"_"+what, func(t *testing.T) {
				store := NewPostgresStore(pool)
				key := unique(limit + 1)
				if what == "scope" {
					store.Scope = unique(limit + 1)
					key = unique(limit)
				}
				g := &Guard{Store: store, Retention: time.Hour}
				ran := 0
				out, err := call(g, key, &ran)
				var pg *pgconn.PgError
				if out != Unavailable || !errors.Is(err, ErrUnavailable) || !errors.As(err, &pg) || pg.Code != "22001" {
					t.Fatalf("got %v, %v; want Unavailable wrapping SQLSTATE 22001", out, err)
				}
				if ran != 0 {
					t.Fatalf("the handler ran %d times", ran)
				}
				if st := lookup(t, store.Scope, key); st.found {
					t.Fatalf("the key was claimed: %+v", st)
				}
			})
		}
	}
}
