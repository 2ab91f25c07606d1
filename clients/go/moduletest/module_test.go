// Package moduletest is built by clients/go/test.sh in module mode, as a
// user's module that requires idem/clients/go, replaces it with this
// clone's clients/go and takes pgx v4 from Debian's sources through
// vendor/ (clients/go/README.md, "Module mode, offline").  It is not
// part of the client; in GOPATH mode it builds and runs alike.
package moduletest

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v4/pgxpool"

	"idem/clients/go/idempotency"
)

// TestModuleMode claims, completes and replays a key through Guard.Do with
// a PostgresStore, against the database of IDEM_TEST_DSN.
func TestModuleMode(t *testing.T) {
	dsn := os.Getenv("IDEM_TEST_DSN")
	if dsn == "" {
		t.Fatal("IDEM_TEST_DSN is not set")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pool, err := pgxpool.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	g := &idempotency.Guard{Store: idempotency.NewPostgresStore(pool),
		Lease: 30 * time.Second, Retention: time.Hour}
	key := fmt.Sprintf("module-mode-%d", time.Now().UnixNano())
	runs := 0
	handler := func(ctx context.Context) (idempotency.Response, error) {
		runs++
		return idempotency.Response{Status: 201, Body: []byte("module mode")}, nil
	}
	for i, want := range []idempotency.Outcome{idempotency.Executed, idempotency.Replayed} {
		resp, outcome, err := g.Do(ctx, key, "fp", handler)
		if err != nil || outcome != want || resp.Status != 201 || string(resp.Body) != "module mode" {
			t.Fatalf("call %d: %v %d %q %v, want %v 201 \"module mode\" <nil>",
				i+1, outcome, resp.Status, resp.Body, err, want)
		}
	}
	if runs != 1 {
		t.Fatalf("the handler ran %d times, want 1", runs)
	}
}
