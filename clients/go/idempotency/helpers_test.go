package idempotency

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// The tests run against a live server with CREATE EXTENSION idem done,
// named by IDEM_TEST_DSN and reached as a superuser (the tests move time
// with idem.clock_offset).

var (
	testPool  *pgxpool.Pool
	scopeSeq  int64
	scopeBase = fmt.Sprintf("go-%d", time.Now().UnixNano())
)

func TestMain(m *testing.M) {
	dsn := os.Getenv("IDEM_TEST_DSN")
	if dsn == "" {
		fmt.Fprintln(os.Stderr, "IDEM_TEST_DSN is not set: run clients/go/test.sh")
		os.Exit(2)
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		fmt.Fprintln(os.Stderr, "IDEM_TEST_DSN:", err)
		os.Exit(2)
	}
	cfg.MaxConns = 12
	testPool, err = pgxpool.ConnectConfig(context.Background(), cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "connect:", err)
		os.Exit(2)
	}
	code := m.Run()
	testPool.Close()
	os.Exit(code)
}

// newScope returns a scope no other test uses, so each test sees only its
// own keys.
func newScope(t *testing.T) string {
	return fmt.Sprintf("%s-%d-%s", scopeBase, atomic.AddInt64(&scopeSeq, 1), t.Name())
}

// testLease is the lease of the tests that set the guard's clock (Guard.Now
// with ClientClock).  The store turns the guard's now into a whole-second
// idem.clock_offset against the server's clock, so the server time of a
// call lies within half a second of now plus the time the call took
// between setting the offset and claiming: two calls at the same now may
// be a second and a stall apart.  A lease of ten seconds keeps a key in
// flight through any stall a loaded machine makes.
const testLease = 10 * time.Second

// pastLease moves the guard's clock past a testLease claimed at the old
// now, with the same margin for the rounding and stalls.
const pastLease = 2 * testLease

// newTestStore is the PostgreSQL store the ported tests use in place of
// NewMemoryStore(): it follows the guard's clock (Guard.Now) as the
// memory store does.
func newTestStore(t *testing.T) *PostgresStore {
	s := NewPostgresStore(testPool)
	s.ClientClock = true
	s.Scope = newScope(t)
	return s
}

// newPool connects a pool with extra run-time parameters.
func newPool(t *testing.T, dsn string, params map[string]string, lazy bool) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	cfg.LazyConnect = lazy
	pool, err := pgxpool.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// stored is a key as idem_lookup shows it.
type stored struct {
	found  bool
	state  string
	token  int64
	status *int32
	lease  *time.Time // lease_until; nil once completed
	size   *int32
}

func lookup(t *testing.T, scope, key string) stored {
	t.Helper()
	var st stored
	err := testPool.QueryRow(context.Background(),
		"SELECT state, token, status, lease_until, body_size FROM public.idem_lookup($1::text, $2::text)",
		key, scope).Scan(&st.state, &st.token, &st.status, &st.lease, &st.size)
	if err == pgx.ErrNoRows {
		return stored{}
	}
	if err != nil {
		t.Fatalf("idem_lookup(%q): %v", key, err)
	}
	st.found = true
	return st
}

// opCounter is a Fault hook that counts the calls of each operation and
// fails none.
type opCounter struct{ begin, complete, release, extend int64 }

func (c *opCounter) fault(op string) error {
	switch op {
	case "begin":
		atomic.AddInt64(&c.begin, 1)
	case "complete":
		atomic.AddInt64(&c.complete, 1)
	case "release":
		atomic.AddInt64(&c.release, 1)
	case "extend":
		atomic.AddInt64(&c.extend, 1)
	}
	return nil
}

func (c *opCounter) extends() int64 { return atomic.LoadInt64(&c.extend) }

// waitFor polls cond every 20 ms for at most d.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// serverPast tells whether the server's clock (idem's, without an offset)
// is past ts.
func serverPast(t *testing.T, ts time.Time) bool {
	t.Helper()
	var past bool
	if err := testPool.QueryRow(context.Background(),
		"SELECT pg_catalog.clock_timestamp() > $1::timestamptz", ts).Scan(&past); err != nil {
		t.Fatal(err)
	}
	return past
}

func dsn() string { return os.Getenv("IDEM_TEST_DSN") }
