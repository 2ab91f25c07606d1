package idempotency

// Round trips of every path, counted on the wire (countedPool: every
// Write of the connection is one request answered before the next), once
// the connection has prepared the statements, with and without a
// deadline on the context.  Issue 46's bound: a replay of the default
// path one round trip, of a transactional one two (the claim with its
// BEGIN, then the end); a new key adds only the complete and the commit.

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v4"
)

func TestRoundTrips(t *testing.T) {
	for _, deadline := range []bool{false, true} {
		t.Run(fmt.Sprintf("deadline=%v", deadline), func(t *testing.T) {
			pool, writes := countedPool(t, false)
			store := NewPostgresStore(pool)
			store.Scope = newScope(t)
			g := &Guard{Store: store}
			ctx := bg
			if deadline {
				c, cancel := context.WithTimeout(bg, time.Hour)
				defer cancel()
				ctx = c
			}
			var calls atomic.Int32
			one := func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "SELECT 1", extended)
				return err
			}
			txHandler := func(ctx context.Context, tx pgx.Tx) (Response, error) {
				return Response{Status: 201, Body: []byte("tx")}, one(ctx, tx)
			}
			manyTx := func(ctx context.Context, tx pgx.Tx, i int) (Response, error) {
				return Response{Status: 200}, one(ctx, tx)
			}
			many := func(ctx context.Context, i int) (Response, error) { return Response{Status: 200}, nil }
			inbox := &Inbox{Store: store, Queue: store.Scope + "-q"}
			consume := func(ctx context.Context, tx pgx.Tx, m Message) error { return one(ctx, tx) }
			steps := func(ctx context.Context) (Response, error) {
				if _, err := Step(ctx, "a", func(context.Context, StepInfo) (int, error) { return 1, nil }); err != nil {
					return Response{}, err
				}
				return Response{Status: 200}, nil
			}
			stepTx := func(ctx context.Context) (Response, error) {
				if _, err := StepTx(ctx, "a", func(ctx context.Context, tx pgx.Tx, _ StepInfo) (int, error) {
					return 1, one(ctx, tx)
				}); err != nil {
					return Response{}, err
				}
				return Response{Status: 200}, nil
			}
			items := func(p string) []Item {
				return []Item{{Key: p + "-1", Fingerprint: "fp"}, {Key: p + "-2", Fingerprint: "fp"}, {Key: p + "-3", Fingerprint: "fp"}}
			}
			msgs := func(p string) []Message {
				return []Message{{ID: p + "-1"}, {ID: p + "-2"}}
			}
			// A claim held by nobody here, committed: the key is in flight.
			if _, claimed, err := store.Begin(bg, "held", "fp", time.Now(), time.Hour, 0); !claimed || err != nil {
				t.Fatalf("held: claimed=%v err=%v", claimed, err)
			}
			// Each path runs once on a warm-up key first, so that the
			// connection has prepared its statements.
			for _, c := range []struct {
				name string
				run  func(key string) (Outcome, error)
				want int64
			}{
				{"Do new key", func(k string) (Outcome, error) {
					_, out, err := g.Do(ctx, k, "fp", okHandler(&calls))
					return out, err
				}, 2},
				{"Do replay", func(k string) (Outcome, error) {
					_, out, err := g.Do(ctx, k+"-done", "fp", okHandler(&calls))
					return out, err
				}, 1},
				{"Do conflict", func(k string) (Outcome, error) {
					_, out, _ := g.Do(ctx, k+"-done", "other", okHandler(&calls))
					return out, nil
				}, 1},
				{"Do in flight", func(string) (Outcome, error) {
					_, out, _ := g.Do(ctx, "held", "fp", okHandler(&calls))
					return out, nil
				}, 1},
				{"DoTx new key (handler: 1 statement)", func(k string) (Outcome, error) {
					_, out, err := g.DoTx(ctx, k, "fp", txHandler)
					return out, err
				}, 3},
				{"DoTx replay", func(k string) (Outcome, error) {
					_, out, err := g.DoTx(ctx, k+"-done", "fp", txHandler)
					return out, err
				}, 2},
				{"DoTx conflict", func(k string) (Outcome, error) {
					_, out, _ := g.DoTx(ctx, k+"-done", "other", txHandler)
					return out, nil
				}, 2},
				{"DoTx in flight", func(string) (Outcome, error) {
					_, out, _ := g.DoTx(ctx, "held", "fp", txHandler)
					return out, nil
				}, 2},
				{"DoMany new keys (3)", func(k string) (Outcome, error) {
					r := g.DoMany(ctx, items(k), many)
					return r[2].Outcome, r[2].Err
				}, 2},
				{"DoMany replay (3)", func(k string) (Outcome, error) {
					r := g.DoMany(ctx, items(k+"-done"), many)
					return r[2].Outcome, r[2].Err
				}, 1},
				// Each handler runs in a savepoint: SAVEPOINT, its
				// statement, RELEASE.
				{"DoManyTx new keys (3, handler: 1 statement)", func(k string) (Outcome, error) {
					r, err := g.DoManyTx(ctx, items(k), manyTx)
					return r[2].Outcome, err
				}, 2 + 3*3},
				{"DoManyTx replay (3)", func(k string) (Outcome, error) {
					r, err := g.DoManyTx(ctx, items(k+"-done"), manyTx)
					return r[2].Outcome, err
				}, 2},
				{"Inbox.Consume new (2, handler: 1 statement)", func(k string) (Outcome, error) {
					d, err := inbox.Consume(ctx, msgs(k), consume)
					return d[1].Outcome, err
				}, 2 + 2*3},
				{"Inbox.Consume redelivered (2)", func(k string) (Outcome, error) {
					d, err := inbox.Consume(ctx, msgs(k+"-done"), consume)
					return d[1].Outcome, err
				}, 2},
				// The claim, the step's checkpoint, the complete.
				{"Do with a Step", func(k string) (Outcome, error) {
					_, out, err := g.Do(ctx, k, "fp", steps)
					return out, err
				}, 3},
				// The claim; the hold's batch (BEGIN, hold), the step's
				// statement, its checkpoint with COMMIT; the complete.
				{"Do with a StepTx (1 statement)", func(k string) (Outcome, error) {
					_, out, err := g.Do(ctx, k, "fp", stepTx)
					return out, err
				}, 5},
			} {
				c := c
				t.Run(c.name, func(t *testing.T) {
					// The warm-up, and the keys a replay finds done.
					if _, err := c.run("warm-" + c.name); err != nil {
						t.Fatalf("warm-up: %v", err)
					}
					if _, err := c.run("warm2-" + c.name); err != nil {
						t.Fatalf("warm-up: %v", err)
					}
					g.Do(ctx, "k-"+c.name+"-done", "fp", okHandler(&calls))
					g.DoTx(ctx, "k-"+c.name+"-done", "fp", txHandler)
					g.DoMany(ctx, items("k-"+c.name+"-done"), many)
					inbox.Consume(ctx, msgs("k-"+c.name+"-done"), consume)
					writes.Store(0)
					out, err := c.run("k-" + c.name)
					if n := writes.Load(); n != c.want {
						t.Fatalf("round trips %d, want %d (out=%s err=%v)", n, c.want, out, err)
					}
					want := Executed
					for word, o := range map[string]Outcome{"replay": Replayed, "redelivered": Replayed,
						"conflict": Conflicted, "in flight": InFlight} {
						if strings.Contains(c.name, word) {
							want = o
						}
					}
					if out != want {
						t.Fatalf("outcome %s, want %s (err=%v)", out, want, err)
					}
					t.Logf("%s: %d round trips, outcome %s", c.name, c.want, out)
				})
			}
		})
	}
}
