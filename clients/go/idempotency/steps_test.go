package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

// The steps of issue #27: a handler whose process stops after two of its
// three steps is resumed by the retry that takes the key over, which
// skips the two with their outputs and runs the third once.

var errCrash = errors.New("the process stopped here")

type reservation struct {
	Hold  string `json:"hold"`
	Token int64  `json:"token"`
}

type charge struct {
	ID          string `json:"id"`
	ProviderKey string `json:"provider_key"`
}

// threeSteps is a handler of three steps (reserve, charge, ship) that
// counts the runs of each and stops after charge while crash is set.
type threeSteps struct {
	mu      sync.Mutex
	runs    map[string]int
	crash   bool
	charges map[string]int // provider key -> charges the provider made
	seen    []string       // what each attempt's steps returned
}

func newThreeSteps() *threeSteps {
	return &threeSteps{runs: map[string]int{}, charges: map[string]int{}}
}

func (h *threeSteps) ran(name string) {
	h.mu.Lock()
	h.runs[name]++
	h.mu.Unlock()
}

func (h *threeSteps) count(name string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.runs[name]
}

func (h *threeSteps) handle(ctx context.Context) (Response, error) {
	res, err := Step(ctx, "reserve", func(ctx context.Context, s StepInfo) (reservation, error) {
		h.ran("reserve")
		return reservation{Hold: fmt.Sprintf("hold-%d", s.Token), Token: s.Token}, nil
	})
	if err != nil {
		return Response{}, err
	}
	ch, err := Step(ctx, "charge", func(ctx context.Context, s StepInfo) (charge, error) {
		h.ran("charge")
		h.mu.Lock()
		h.charges[s.IdempotencyKey()]++
		h.mu.Unlock()
		return charge{ID: fmt.Sprintf("ch-%d", s.Token), ProviderKey: s.IdempotencyKey()}, nil
	})
	if err != nil {
		return Response{}, err
	}
	if h.crash {
		return Response{}, errCrash
	}
	shipped, err := Step(ctx, "ship", func(ctx context.Context, s StepInfo) (string, error) {
		h.ran("ship")
		return "shipped " + res.Hold + " " + ch.ID, nil
	})
	if err != nil {
		return Response{}, err
	}
	st, _ := StepsFromContext(ctx)
	h.mu.Lock()
	h.seen = append(h.seen, fmt.Sprintf("resumed=%s done=%v", st.Resumed(), st.Done()))
	h.mu.Unlock()
	return Response{Status: 201, Body: []byte(shipped)}, nil
}

func TestStepsResumeAfterTakeover(t *testing.T) {
	stores := map[string]func(t *testing.T) Store{
		"postgres": func(t *testing.T) Store { return newTestStore(t) },
		"memory":   func(t *testing.T) Store { return NewMemoryStore() },
	}
	for _, name := range []string{"postgres", "memory"} {
		newStore := stores[name]
		t.Run(name, func(t *testing.T) {
			now := base
			var mu sync.Mutex
			clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
			g := &Guard{Store: newStore(t), Lease: testLease, Retention: time.Hour, Now: clock}
			h := newThreeSteps()

			// The first attempt stops after charge: no complete, no release.
			h.crash = true
			_, out, err := g.Do(bg, "order-7", "fp", h.handle)
			if out != Executed || !errors.Is(err, errCrash) {
				t.Fatalf("first attempt: out=%s err=%v", out, err)
			}
			if h.count("reserve") != 1 || h.count("charge") != 1 || h.count("ship") != 0 {
				t.Fatalf("first attempt ran %v", h.runs)
			}
			// Inside the lease the key is in flight.
			h.crash = false
			if _, out, err := g.Do(bg, "order-7", "fp", h.handle); out != InFlight || !errors.Is(err, ErrInFlight) {
				t.Fatalf("inside the lease: out=%s err=%v", out, err)
			}
			// After it, the retry takes over and resumes after charge.
			mu.Lock()
			now = now.Add(pastLease)
			mu.Unlock()
			resp, out, err := g.Do(bg, "order-7", "fp", h.handle)
			if out != Executed || err != nil {
				t.Fatalf("retry: out=%s err=%v", out, err)
			}
			if h.count("reserve") != 1 || h.count("charge") != 1 || h.count("ship") != 1 {
				t.Fatalf("after the retry: runs %v", h.runs)
			}
			// ship got the first attempt's outputs (its token, not the retry's).
			var first int64
			if _, err := fmt.Sscanf(string(resp.Body), "shipped hold-%d ch-", &first); err != nil || first <= 0 ||
				string(resp.Body) != fmt.Sprintf("shipped hold-%d ch-%d", first, first) {
				t.Fatalf("response %q (%v)", resp.Body, err)
			}
			if len(h.seen) != 1 || h.seen[0] != "resumed=charge done=[reserve charge ship]" {
				t.Fatalf("steps seen: %v", h.seen)
			}
			if len(h.charges) != 1 {
				t.Fatalf("provider keys: %v", h.charges)
			}
			// Done: replayed, nothing runs again.
			resp2, out, err := g.Do(bg, "order-7", "fp", h.handle)
			if out != Replayed || err != nil || string(resp2.Body) != string(resp.Body) {
				t.Fatalf("replay: out=%s err=%v body=%q", out, err, resp2.Body)
			}
			if h.count("ship") != 1 {
				t.Fatalf("runs after the replay: %v", h.runs)
			}
			t.Logf("%s: runs=%v response=%q", name, h.runs, resp.Body)
		})
	}
}

// A step whose process stops after the provider charged but before the
// step's checkpoint runs again after the takeover, with the same provider
// key: a provider that keeps its idempotency keys charges once.
func TestStepProviderKeyStableAcrossTakeover(t *testing.T) {
	store := newTestStore(t)
	now := base
	var mu sync.Mutex
	g := &Guard{Store: store, Lease: testLease, Retention: time.Hour,
		Now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }}
	provider := map[string]string{} // provider key -> charge id
	var tokens []int64
	charges := 0
	chargeStep := func(crash bool) func(ctx context.Context) (Response, error) {
		return func(ctx context.Context) (Response, error) {
			id, err := Step(ctx, "charge", func(ctx context.Context, s StepInfo) (string, error) {
				tokens = append(tokens, s.Token)
				if id, ok := provider[s.IdempotencyKey()]; ok {
					return id, nil // the provider answers with the first charge
				}
				charges++
				provider[s.IdempotencyKey()] = fmt.Sprintf("ch-%d", charges)
				if crash {
					return "", errCrash // charged, then stopped before the checkpoint
				}
				return provider[s.IdempotencyKey()], nil
			})
			if err != nil {
				return Response{}, err
			}
			return Response{Status: 200, Body: []byte(id)}, nil
		}
	}
	if _, out, err := g.Do(bg, "pay-1", "fp", chargeStep(true)); out != Executed || !errors.Is(err, errCrash) {
		t.Fatalf("first: %s %v", out, err)
	}
	mu.Lock()
	now = now.Add(pastLease)
	mu.Unlock()
	resp, out, err := g.Do(bg, "pay-1", "fp", chargeStep(false))
	if out != Executed || err != nil || string(resp.Body) != "ch-1" || charges != 1 {
		t.Fatalf("retry: %s %v %q charges=%d", out, err, resp.Body, charges)
	}
	if len(tokens) != 2 || tokens[1] <= tokens[0] {
		t.Fatalf("tokens %v", tokens)
	}
	for k := range provider {
		if k != store.Scope+":pay-1:charge" {
			t.Fatalf("provider key %q", k)
		}
	}
}

// stepTable makes a table of business rows for one test.
func stepTable(t *testing.T) string {
	t.Helper()
	name := pgx.Identifier{fmt.Sprintf("step_rows_%d", time.Now().UnixNano())}.Sanitize()
	if _, err := testPool.Exec(bg, "CREATE TABLE "+name+" (step text NOT NULL, token bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testPool.Exec(context.Background(), "DROP TABLE "+name) })
	return name
}

func stepRows(t *testing.T, table string) []string {
	t.Helper()
	rows, err := testPool.Query(bg, "SELECT step || ':' || token FROM "+table+" ORDER BY step")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

func insertStep(table string) func(ctx context.Context, tx pgx.Tx, s StepInfo) (int64, error) {
	return func(ctx context.Context, tx pgx.Tx, s StepInfo) (int64, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1, $2)", s.Name, s.Token)
		return s.Token, err
	}
}

func TestStepTx(t *testing.T) {
	t.Run("writes_and_checkpoint_commit_together", func(t *testing.T) {
		table := stepTable(t)
		store := newTestStore(t)
		now := base
		var mu sync.Mutex
		g := &Guard{Store: store, Lease: testLease, Retention: time.Hour,
			Now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now }}
		boom := errors.New("constraint of the business")
		runs := 0
		handler := func(fail bool) func(ctx context.Context) (Response, error) {
			return func(ctx context.Context) (Response, error) {
				a, err := StepTx(ctx, "a", insertStep(table))
				if err != nil {
					return Response{}, err
				}
				b, err := StepTx(ctx, "b", func(ctx context.Context, tx pgx.Tx, s StepInfo) (int64, error) {
					runs++
					if _, err := insertStep(table)(ctx, tx, s); err != nil {
						return 0, err
					}
					if fail {
						return 0, boom // after the insert: rolled back with it
					}
					return s.Token, nil
				})
				if err != nil {
					return Response{}, err
				}
				return Response{Status: 200, Body: []byte(fmt.Sprintf("%d %d", a, b))}, nil
			}
		}
		if _, out, err := g.Do(bg, "tx-steps", "fp", handler(true)); out != Executed || !errors.Is(err, boom) {
			t.Fatalf("first: %s %v", out, err)
		}
		rows := stepRows(t, table)
		if len(rows) != 1 || rows[0][:2] != "a:" {
			t.Fatalf("rows after the failed step: %v", rows)
		}
		mu.Lock()
		now = now.Add(pastLease)
		mu.Unlock()
		resp, out, err := g.Do(bg, "tx-steps", "fp", handler(false))
		if out != Executed || err != nil {
			t.Fatalf("retry: %s %v", out, err)
		}
		rows = stepRows(t, table)
		var ta, tb int64
		if len(rows) != 2 || runs != 2 {
			t.Fatalf("rows %v runs %d", rows, runs)
		}
		fmt.Sscanf(rows[0], "a:%d", &ta)
		fmt.Sscanf(rows[1], "b:%d", &tb)
		if tb <= ta || string(resp.Body) != fmt.Sprintf("%d %d", ta, tb) {
			t.Fatalf("rows %v response %q", rows, resp.Body)
		}
	})

	t.Run("stale_holder_writes_nothing", func(t *testing.T) {
		table := stepTable(t)
		store := newTestStore(t)
		now := base
		var mu sync.Mutex
		clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
		g := &Guard{Store: store, Lease: testLease, Retention: time.Hour, Now: clock}
		var staleTx, staleStep error
		txRan, stepRan := false, false
		var resumed string
		_, out, err := g.Do(bg, "stale", "fp", func(ctx context.Context) (Response, error) {
			if _, err := StepTx(ctx, "reserve", insertStep(table)); err != nil {
				return Response{}, err
			}
			// This holder stalls past its lease; another caller takes
			// the key over (and keeps it: its handler fails).
			mu.Lock()
			now = now.Add(pastLease)
			mu.Unlock()
			_, out, err := g.Do(bg, "stale", "fp", func(ctx context.Context) (Response, error) {
				st, _ := StepsFromContext(ctx)
				resumed = st.Resumed()
				return Response{}, errCrash
			})
			if out != Executed || !errors.Is(err, errCrash) {
				t.Errorf("takeover: %s %v", out, err)
			}
			// The stale holder goes on.
			_, staleTx = StepTx(ctx, "charge", func(ctx context.Context, tx pgx.Tx, s StepInfo) (int64, error) {
				txRan = true
				return insertStep(table)(ctx, tx, s)
			})
			_, staleStep = Step(ctx, "notify", func(ctx context.Context, s StepInfo) (bool, error) {
				stepRan = true
				return true, nil
			})
			return Response{Status: 200}, nil
		})
		if out != Executed || !errors.Is(err, ErrSuperseded) {
			t.Fatalf("stale holder's complete: %s %v", out, err)
		}
		if resumed != "reserve" {
			t.Fatalf("the takeover resumed from %q", resumed)
		}
		if !errors.Is(staleTx, ErrSuperseded) || txRan {
			t.Fatalf("stale StepTx: err=%v ran=%v", staleTx, txRan)
		}
		var ie *Error
		if !errors.As(staleTx, &ie) || ie.Code != "ID002" {
			t.Fatalf("stale StepTx error %#v", staleTx)
		}
		// A Step's work outside the database cannot be held back; its
		// checkpoint is refused.
		if !errors.Is(staleStep, ErrSuperseded) || !stepRan {
			t.Fatalf("stale Step: err=%v ran=%v", staleStep, stepRan)
		}
		if rows := stepRows(t, table); len(rows) != 1 || rows[0][:8] != "reserve:" {
			t.Fatalf("business rows %v", rows)
		}
	})
}

func TestCheckpointFenced(t *testing.T) {
	for _, name := range []string{"postgres", "memory"} {
		t.Run(name, func(t *testing.T) {
			var s interface {
				Store
				Checkpointer
				Releaser
			}
			if name == "postgres" {
				s = newTestStore(t)
			} else {
				s = NewMemoryStore()
			}
			now := base
			if err := s.Checkpoint(bg, "none", 1, "a", []byte(`{"a":1}`), now); !errors.Is(err, ErrNoClaim) {
				t.Fatalf("no claim: %v", err)
			}
			rec, claimed, err := s.Begin(bg, "k", "fp", now, testLease, time.Hour)
			if err != nil || !claimed || rec.Phase != "" || rec.PhaseData != nil {
				t.Fatalf("begin: %+v %v %v", rec, claimed, err)
			}
			if err := s.Checkpoint(bg, "k", rec.Token, "a", []byte(`{"a":1}`), now); err != nil {
				t.Fatalf("checkpoint: %v", err)
			}
			if err := s.Checkpoint(bg, "k", rec.Token, "b", []byte(`{"a":1,"b":2}`), now); err != nil {
				t.Fatalf("second checkpoint: %v", err)
			}
			if err := s.Checkpoint(bg, "k", rec.Token, "", nil, now); err == nil {
				t.Fatal("an empty phase was taken")
			}
			// Inside the lease: in flight, no recovery point shown.
			if rec2, claimed, err := s.Begin(bg, "k", "fp", now, testLease, time.Hour); err != nil || claimed || rec2.Phase != "" {
				t.Fatalf("in flight: %+v %v %v", rec2, claimed, err)
			}
			later := now.Add(pastLease)
			rec2, claimed, err := s.Begin(bg, "k", "fp", later, testLease, time.Hour)
			if err != nil || !claimed || rec2.Phase != "b" || string(rec2.PhaseData) != `{"a":1,"b":2}` {
				t.Fatalf("takeover: %+v %v %v", rec2, claimed, err)
			}
			if err := s.Checkpoint(bg, "k", rec.Token, "c", nil, later); !errors.Is(err, ErrSuperseded) {
				t.Fatalf("stale checkpoint: %v", err)
			}
			if err := s.Complete(WithClaim(bg, Claim{Key: "k", Token: rec2.Token}), "k", "fp", Response{Status: 200}, later, time.Hour); err != nil {
				t.Fatal(err)
			}
			if err := s.Checkpoint(bg, "k", rec2.Token, "c", nil, later); !errors.Is(err, ErrAlreadyCompleted) {
				t.Fatalf("checkpoint of a completed key: %v", err)
			}
			if name == "postgres" {
				var ie *Error
				err := s.Checkpoint(bg, "k", rec2.Token, "c", nil, later)
				if !errors.As(err, &ie) || ie.Code != "ID004" {
					t.Fatalf("%#v", err)
				}
				var pg *pgconn.PgError
				err = s.Checkpoint(bg, "k", rec2.Token, "", nil, later)
				if !errors.As(err, &pg) || (pg.Code != "22023" && pg.Code != "22004") {
					t.Fatalf("empty phase: %#v", err)
				}
			}
		})
	}
}

func TestStepsErrors(t *testing.T) {
	if _, err := Step(bg, "a", func(context.Context, StepInfo) (int, error) { return 1, nil }); !errors.Is(err, ErrNoSteps) {
		t.Fatalf("outside Do: %v", err)
	}
	// DoTx's handler has no steps: its work commits at once.
	store := newTestStore(t)
	g := &Guard{Store: store, Lease: testLease, Retention: time.Hour, Now: func() time.Time { return base }}
	_, _, err := g.DoTx(bg, "tx", "fp", func(ctx context.Context, tx pgx.Tx) (Response, error) {
		_, err := Step(ctx, "a", func(context.Context, StepInfo) (int, error) { return 1, nil })
		return Response{Status: 200}, err
	})
	if !errors.Is(err, ErrNoSteps) {
		t.Fatalf("in DoTx: %v", err)
	}
	// A recovery point that steps did not write.
	rec, _, err := store.Begin(bg, "foreign", "fp", base, testLease, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Checkpoint(bg, "foreign", rec.Token, "x", []byte("not json"), base); err != nil {
		t.Fatal(err)
	}
	ran := false
	_, out, err := g.Do(bg, "foreign", "fp", func(ctx context.Context) (Response, error) {
		_, err := Step(ctx, "x", func(context.Context, StepInfo) (int, error) { ran = true; return 1, nil })
		return Response{}, err
	})
	if out != InFlight {
		t.Fatalf("inside the lease: %s", out)
	}
	g.Now = func() time.Time { return base.Add(pastLease) }
	_, out, err = g.Do(bg, "foreign", "fp", func(ctx context.Context) (Response, error) {
		_, err := Step(ctx, "x", func(context.Context, StepInfo) (int, error) { ran = true; return 1, nil })
		return Response{}, err
	})
	if out != Executed || !errors.Is(err, ErrCheckpointData) || ran {
		t.Fatalf("foreign recovery point: %s %v ran=%v", out, err, ran)
	}
	// A step that ran in this claim returns its output when called again.
	mem := &Guard{Store: NewMemoryStore(), Lease: time.Minute, Retention: time.Hour}
	calls := 0
	resp, _, err := mem.Do(bg, "twice", "fp", func(ctx context.Context) (Response, error) {
		var outs []json.RawMessage
		for i := 0; i < 2; i++ {
			out, err := Step(ctx, "once", func(context.Context, StepInfo) (json.RawMessage, error) {
				calls++
				return json.RawMessage(`{"n":1}`), nil
			})
			if err != nil {
				return Response{}, err
			}
			outs = append(outs, out)
		}
		return Response{Status: 200, Body: append(outs[0], outs[1]...)}, nil
	})
	if err != nil || calls != 1 || string(resp.Body) != `{"n":1}{"n":1}` {
		t.Fatalf("twice: %v calls=%d %q", err, calls, resp.Body)
	}
}

// ReleaseOnError gives up a claim without steps, but leaves one with a
// finished step to its lease, so that the retry resumes after it.
func TestReleaseOnErrorKeepsSteps(t *testing.T) {
	store := NewMemoryStore()
	g := &Guard{Store: store, Lease: time.Minute, Retention: time.Hour, ReleaseOnError: true,
		Now: func() time.Time { return base }}
	_, _, err := g.Do(bg, "plain", "fp", func(ctx context.Context) (Response, error) { return Response{}, errCrash })
	if !errors.Is(err, errCrash) {
		t.Fatal(err)
	}
	if _, claimed, _ := store.Begin(bg, "plain", "fp", base, time.Minute, time.Hour); !claimed {
		t.Fatal("a claim without steps was not released")
	}
	_, _, err = g.Do(bg, "stepped", "fp", func(ctx context.Context) (Response, error) {
		if _, err := Step(ctx, "a", func(context.Context, StepInfo) (int, error) { return 1, nil }); err != nil {
			return Response{}, err
		}
		return Response{}, errCrash
	})
	if !errors.Is(err, errCrash) {
		t.Fatal(err)
	}
	if _, claimed, _ := store.Begin(bg, "stepped", "fp", base, time.Minute, time.Hour); claimed {
		t.Fatal("a claim with a finished step was released")
	}
}
