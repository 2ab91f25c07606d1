package idempotency

// The two tests of the Go package this guard comes from, against
// PostgreSQL: the changes are the store (newTestStore instead of
// NewMemoryStore) and a longer lease (testLease instead of a second, and
// pastLease to step past it; see helpers_test.go).

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// base is the guard's clock at the start of the tests that set it: a whole
// hour a day ahead of the real clock.  A key stored at base with an hour's
// retention is then not expired by the server's own clock while the test
// runs (idem_lookup and any purge pass use that clock), and a call that
// ignored the guard's clock would be a day off, not a few seconds.
var base = time.Now().UTC().Truncate(time.Hour).Add(24 * time.Hour)

// inventory is the downstream system: it absorbs a repeated reservation of
// the same key, as a provider's own idempotency key would.
type inventory struct {
	mu           sync.Mutex
	stock        int
	reservations map[string]int
	charges      map[string]int
}

func newInventory(stock int) *inventory {
	return &inventory{stock: stock, reservations: map[string]int{}, charges: map[string]int{}}
}

func (inv *inventory) reserve(key string, qty, cents int) error {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	if _, seen := inv.reservations[key]; seen {
		return nil
	}
	if inv.stock < qty {
		return errors.New("OUT_OF_STOCK")
	}
	inv.stock -= qty
	inv.reservations[key] = qty
	inv.charges[key] = cents
	return nil
}

func guardAt(store Store, clock *time.Time) *Guard {
	return &Guard{Store: store, Lease: testLease, Retention: time.Hour,
		Now: func() time.Time { return *clock }}
}

func reserveHandler(inv *inventory, key string, calls *atomic.Int32, delay time.Duration) func(context.Context) (Response, error) {
	return func(context.Context) (Response, error) {
		calls.Add(1)
		time.Sleep(delay)
		if err := inv.reserve(key, 1, 1000); err != nil {
			return Response{Status: 409, Body: []byte("OUT_OF_STOCK")}, nil
		}
		return Response{Status: 200, Body: []byte("paid")}, nil
	}
}

func TestConcurrentSameKeyAndFingerprintConflict(t *testing.T) {
	store := newTestStore(t)
	now := base
	g := guardAt(store, &now)
	inv := newInventory(10)
	var calls atomic.Int32
	const workers = 8
	outcomes := make([]Outcome, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			_, out, err := g.Do(context.Background(), "order-1", "sku=A&qty=1",
				reserveHandler(inv, "order-1", &calls, 20*time.Millisecond))
			if err != nil && !errors.Is(err, ErrInFlight) {
				t.Errorf("worker %d: %v", w, err)
			}
			outcomes[w] = out
		}(w)
	}
	wg.Wait()
	executed := 0
	for _, out := range outcomes {
		if out == Executed {
			executed++
		}
	}
	if executed != 1 || calls.Load() != 1 || inv.stock != 9 || len(inv.reservations) != 1 || len(inv.charges) != 1 {
		t.Fatalf("executed=%d calls=%d stock=%d reservations=%d charges=%d outcomes=%v",
			executed, calls.Load(), inv.stock, len(inv.reservations), len(inv.charges), outcomes)
	}
	_, out, err := g.Do(context.Background(), "order-1", "sku=A&qty=2", reserveHandler(inv, "order-1", &calls, 0))
	if !errors.Is(err, ErrConflict) || out != Conflicted || calls.Load() != 1 {
		t.Fatalf("conflict: out=%s err=%v calls=%d", out, err, calls.Load())
	}
	t.Logf("workers=%d executed=%d calls=%d stock=%d", workers, executed, calls.Load(), inv.stock)
}

func TestLeaseTakeoverFaultInjectionAndWindow(t *testing.T) {
	store := newTestStore(t)
	now := base
	g := guardAt(store, &now)
	inv := newInventory(10)
	var calls atomic.Int32
	failures := 1
	store.Fault = func(op string) error {
		if op == "complete" && failures > 0 {
			failures--
			return errors.New("store timeout")
		}
		return nil
	}
	h := reserveHandler(inv, "order-2", &calls, 0)
	if _, out, err := g.Do(context.Background(), "order-2", "sku=A&qty=1", h); err == nil || out != Executed {
		t.Fatalf("first call: out=%s err=%v", out, err)
	}
	if _, out, err := g.Do(context.Background(), "order-2", "sku=A&qty=1", h); !errors.Is(err, ErrInFlight) || out != InFlight {
		t.Fatalf("inside lease: out=%s err=%v", out, err)
	}
	now = now.Add(pastLease)
	if _, out, err := g.Do(context.Background(), "order-2", "sku=A&qty=1", h); err != nil || out != Executed {
		t.Fatalf("after lease: out=%s err=%v", out, err)
	}
	if calls.Load() != 2 || inv.stock != 9 || len(inv.reservations) != 1 || len(inv.charges) != 1 {
		t.Fatalf("calls=%d stock=%d reservations=%d charges=%d",
			calls.Load(), inv.stock, len(inv.reservations), len(inv.charges))
	}
	now = now.Add(2 * time.Hour)
	if _, out, err := g.Do(context.Background(), "order-2", "sku=A&qty=1", h); err != nil || out != Executed || calls.Load() != 3 {
		t.Fatalf("after window: out=%s err=%v calls=%d", out, err, calls.Load())
	}
	t.Logf("calls=%d stock=%d reservations=%d charges=%d", calls.Load(), inv.stock, len(inv.reservations), len(inv.charges))
	store.Fault = func(string) error { return errors.New("connection refused") }
	if _, out, err := g.Do(context.Background(), "order-3", "sku=A&qty=1", h); !errors.Is(err, ErrUnavailable) || out != Unavailable || calls.Load() != 3 {
		t.Fatalf("store down: out=%s err=%v calls=%d", out, err, calls.Load())
	}
}
