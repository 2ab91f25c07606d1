package idempotency

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// MemoryStore keeps the reference's answers and has the additions too.
func TestMemoryStore(t *testing.T) {
	store := NewMemoryStore()
	now := base
	g := &Guard{Store: store, Lease: time.Second, Retention: time.Hour, Now: func() time.Time { return now }}
	var calls atomic.Int32
	var tokens []int64
	h := func(ctx context.Context) (Response, error) {
		calls.Add(1)
		tok, _ := TokenFromContext(ctx)
		tokens = append(tokens, tok)
		return Response{Status: 200, Body: []byte("ok")}, nil
	}
	fail := 1
	store.Fault = func(op string) error {
		if op == "complete" && fail > 0 {
			fail--
			return errors.New("injected")
		}
		return nil
	}
	if _, out, err := g.Do(bg, "m-1", "fp", h); out != Executed || err == nil {
		t.Fatalf("first: %s %v", out, err)
	}
	if _, out, err := g.Do(bg, "m-1", "fp", h); out != InFlight || !errors.Is(err, ErrInFlight) {
		t.Fatalf("in lease: %s %v", out, err)
	}
	now = now.Add(2 * time.Second)
	if _, out, err := g.Do(bg, "m-1", "fp", h); out != Executed || err != nil {
		t.Fatalf("takeover: %s %v", out, err)
	}
	if len(tokens) != 2 || tokens[0] != 1 || tokens[1] != 2 {
		t.Fatalf("tokens %v", tokens)
	}
	if err := store.Complete(WithClaim(bg, Claim{Key: "m-1", Token: 1}), "m-1", "fp", Response{}, now, time.Hour); err != nil {
		// completed already with token 2: a stale token is refused
		if !errors.Is(err, ErrSuperseded) {
			t.Fatalf("stale complete: %v", err)
		}
	} else {
		t.Fatal("stale complete accepted")
	}
	resp, out, err := g.Do(bg, "m-1", "fp", h)
	if out != Replayed || err != nil || resp.Status != 200 || string(resp.Body) != "ok" || calls.Load() != 2 {
		t.Fatalf("replay: %s %v %+v calls=%d", out, err, resp, calls.Load())
	}
	if _, out, err := g.Do(bg, "m-1", "other", h); out != Conflicted || !errors.Is(err, ErrConflict) {
		t.Fatalf("conflict: %s %v", out, err)
	}
	if _, err := store.Release(bg, "m-1", 2, now); !errors.Is(err, ErrAlreadyCompleted) {
		t.Fatalf("release of a completed key: %v", err)
	}
	g.ReleaseOnError = true
	boom := errors.New("boom")
	if _, out, err := g.Do(bg, "m-2", "fp", func(context.Context) (Response, error) { return Response{}, boom }); out != Executed || !errors.Is(err, boom) {
		t.Fatalf("handler error: %s %v", out, err)
	}
	if _, out, err := g.Do(bg, "m-2", "fp", h); out != Executed || err != nil || calls.Load() != 3 {
		t.Fatalf("after release: %s %v calls=%d", out, err, calls.Load())
	}
	rec, claimed, err := store.Begin(bg, "m-3", "fp", now, time.Second, time.Hour)
	if err != nil || !claimed {
		t.Fatal(claimed, err)
	}
	if until, err := store.Extend(bg, "m-3", rec.Token, now, time.Minute); err != nil || !until.Equal(now.Add(time.Minute)) {
		t.Fatalf("extend: %v %v", until, err)
	}
	if _, err := store.Extend(bg, "m-3", rec.Token+1, now, time.Minute); !errors.Is(err, ErrSuperseded) {
		t.Fatalf("extend with another token: %v", err)
	}
	now = now.Add(2 * time.Hour)
	if _, err := store.Extend(bg, "m-3", rec.Token, now, time.Minute); !errors.Is(err, ErrNoClaim) {
		t.Fatalf("extend after the window: %v", err)
	}
}
