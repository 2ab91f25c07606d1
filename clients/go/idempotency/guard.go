package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"
	"time"
)

// Outcome tells what Do did with a request.
type Outcome string

const (
	Executed    Outcome = "EXECUTED"
	Replayed    Outcome = "REPLAYED"
	InFlight    Outcome = "IN_FLIGHT"
	Conflicted  Outcome = "CONFLICT"
	Unavailable Outcome = "UNAVAILABLE"
	// Expired: the request was executed and completed once and its
	// response's retention is over, but the key is still remembered (a
	// server with tombstones: PostgresStore.Remember).  The handler does
	// not run; the Response carries the first response's status and no
	// body, and the error is ErrExpired.
	Expired Outcome = "EXPIRED"
)

// Guard rejects a mutating request when the store cannot answer instead of
// executing it without dedup protection.
//
// Lease and Retention 0 mean the store's defaults (for PostgresStore, the
// server's idem.default_lease and idem.default_retention).  Now gives the
// time passed to the store; stores that use the server's clock ignore it.
type Guard struct {
	Store     Store
	Lease     time.Duration
	Retention time.Duration
	Now       func() time.Time

	// ReleaseOnError gives the claim up (Releaser) when the handler
	// returns an error, so that a retry may run at once.  By default the
	// key stays in flight until its lease ends, as after a crash.  A claim
	// whose handler finished a step (Step, StepTx), or resumed after
	// steps, is not given up: the retry resumes after them.
	ReleaseOnError bool

	// Heartbeat extends the lease (Extender) every third of Lease (20 s
	// when Lease is 0) while the handler runs.  When the store answers that
	// the claim was superseded, released or completed, the heartbeat stops
	// and the handler's context is cancelled.
	Heartbeat bool

	// WaitFor makes a duplicate of a request in flight wait up to this
	// long for the first request's answer instead of answering InFlight at
	// once.  The store must be a Waiter, as MemoryStore and PostgresStore
	// are; another store answers at once.  When the holder completes,
	// the duplicate replays its response; when the holder releases or its
	// lease ends, the duplicate claims the key and runs the handler; when
	// WaitFor passes, the outcome is InFlight as before.  0 does not wait.
	// ctx's deadline must be later than WaitFor: a deadline that ends the
	// wait first makes the outcome Unavailable.  With a PostgresStore the
	// server does the waiting (idem_begin's wait_for) and ends it at
	// WaitFor; each waiting duplicate holds a connection of the pool for
	// that time.
	WaitFor time.Duration

	// Logf logs what the guard did that the caller did not ask for: a
	// response the store refused, with NotStoredResponse stored in its
	// place.  nil: log.Printf.
	Logf func(format string, args ...interface{})

	// TxRetries makes DoTx run its transaction again, up to this many more
	// times, when it fails with a serialization failure (40001) or a
	// deadlock (40P01), the two errors after which PostgreSQL (and Citus)
	// ask for the transaction to run again.  0 (the default) runs it once.
	// See DoTx.
	TxRetries int
}

func (g *Guard) now() time.Time {
	if g.Now != nil {
		return g.Now()
	}
	return time.Now()
}

func (g *Guard) logf(format string, args ...interface{}) {
	if g.Logf != nil {
		g.Logf(format, args...)
		return
	}
	log.Printf(format, args...)
}

// begin claims key, waiting up to WaitFor when the store can wait.
func (g *Guard) begin(ctx context.Context, key, fingerprint string, now time.Time) (Record, bool, error) {
	if w, ok := g.Store.(Waiter); ok && g.WaitFor > 0 {
		return w.BeginWait(ctx, key, fingerprint, now, g.Lease, g.Retention, g.WaitFor)
	}
	return g.Store.Begin(ctx, key, fingerprint, now, g.Lease, g.Retention)
}

// answer turns a record that was not claimed into Do's result.  A state
// it does not know is Unavailable, not InFlight: that would answer a
// stored response with 409 for as long as it is kept.
func answer(rec Record) (Response, Outcome, error) {
	switch rec.State {
	case Done:
		return rec.Response, Replayed, nil
	case Conflict:
		return Response{}, Conflicted, ErrConflict
	case Processing:
		return Response{}, InFlight, ErrInFlight
	case ResponseExpired:
		return Response{Status: rec.Response.Status}, Expired, ErrExpired
	default:
		return Response{}, Unavailable,
			unavailable(fmt.Errorf("the store answered an unknown state %q", string(rec.State)))
	}
}

// Do claims key, then replays the stored response, refuses (in flight,
// conflict), or runs fn and stores its response.  With WaitFor, a key in
// flight is waited for first.  If the store cannot
// answer the claim, the outcome is Unavailable with ErrUnavailable and fn
// does not run.  fn's context carries the claim and its fencing token
// (ClaimFromContext, TokenFromContext) and, when the store is a
// Checkpointer, the claim's steps: fn may split its work into Step and
// StepTx calls, which a retry that takes the key over after the lease
// skips where they finished (see Step).
//
// A handler error is returned with Executed and nothing is stored.  A
// failed Complete is returned with Executed: the side effect may be
// visible.  If the complete may yet succeed (a lost connection, a timeout:
// see NotStoredError), the key stays in flight until its lease ends.  If
// the store refused the response for good (a data error), Do stores
// NotStoredResponse in its place, logs it (Logf) and returns a
// *NotStoredError: the key is done, and a retry replays the 500 instead of
// running fn again.  Once fn has run, the key is never given up because
// its response could not be stored.
func (g *Guard) Do(ctx context.Context, key, fingerprint string, fn func(context.Context) (Response, error)) (Response, Outcome, error) {
	now := g.now()
	rec, claimed, err := g.begin(ctx, key, fingerprint, now)
	if err != nil {
		return Response{}, Unavailable, unavailable(err)
	}
	if !claimed {
		return answer(rec)
	}
	cctx := WithClaim(ctx, Claim{Key: key, Token: rec.Token})
	if cp, ok := g.Store.(Checkpointer); ok {
		scope := ""
		if ps, ok := g.Store.(*PostgresStore); ok {
			scope = ps.Scope
		}
		cctx = withSteps(cctx, newSteps(cp, key, scope, rec.Token, g.now, rec.Phase, rec.PhaseData))
	}
	hctx := cctx
	var hb *heartbeat
	if ext, ok := g.Store.(Extender); ok && g.Heartbeat {
		hb = g.startHeartbeat(cctx, ext, key, rec.Token)
		hctx = hb.ctx
	}
	resp, ferr := fn(hctx)
	if hb != nil {
		hb.stop()
	}
	if ferr != nil {
		// A claim with a recovery point is left to its lease: a release
		// would delete the finished steps with the key, and the retry
		// would do their work again instead of resuming after them.
		if rel, ok := g.Store.(Releaser); ok && g.ReleaseOnError && !stepsFinished(cctx) {
			if _, rerr := rel.Release(cctx, key, rec.Token, g.now()); rerr != nil {
				return resp, Executed, fmt.Errorf("%w (release failed: %v)", ferr, rerr)
			}
		}
		return resp, Executed, ferr
	}
	if err := g.Store.Complete(cctx, key, fingerprint, resp, now, g.Retention); err != nil {
		if notStorable(err) {
			return resp, Executed, g.storeNotStored(cctx, key, fingerprint, now, err)
		}
		// The side effect may already be visible; the key stays PROCESSING and
		// the downstream idempotency key must absorb the retry.
		return resp, Executed, err
	}
	return resp, Executed, nil
}

// storeNotStored stores NotStoredResponse for key, whose response the
// store refused with err, and logs it.
func (g *Guard) storeNotStored(ctx context.Context, key, fingerprint string, now time.Time, err error) error {
	if serr := g.Store.Complete(ctx, key, fingerprint, NotStoredResponse(), now, g.Retention); serr != nil {
		g.logf("idempotency: response to key %q not stored (%v), nor %d %q in its place (%v)",
			key, err, NotStoredStatus, "Response not stored", serr)
		return fmt.Errorf("%w (storing %d %q in its place failed: %v)", err, NotStoredStatus, "Response not stored", serr)
	}
	nerr := &NotStoredError{Key: key, Err: err}
	g.logf("%v", nerr)
	return nerr
}

// heartbeat extends one claim's lease until stopped or the claim is lost.
type heartbeat struct {
	ctx    context.Context // the handler's: cancelled when the claim is lost
	cancel context.CancelFunc
	quit   chan struct{}
	done   sync.WaitGroup
}

func (g *Guard) startHeartbeat(ctx context.Context, ext Extender, key string, token int64) *heartbeat {
	period := g.Lease / 3
	if g.Lease == 0 {
		period = 20 * time.Second
	}
	if period <= 0 {
		period = time.Millisecond
	}
	hctx, cancel := context.WithCancel(ctx)
	hb := &heartbeat{ctx: hctx, cancel: cancel, quit: make(chan struct{})}
	hb.done.Add(1)
	go func() {
		defer hb.done.Done()
		ticker := time.NewTicker(period)
		defer ticker.Stop()
		for {
			select {
			case <-hb.quit:
				return
			case <-hctx.Done():
				return
			case <-ticker.C:
			}
			_, err := ext.Extend(hctx, key, token, g.now(), g.Lease)
			if errors.Is(err, ErrSuperseded) || errors.Is(err, ErrNoClaim) || errors.Is(err, ErrAlreadyCompleted) {
				cancel()
				return
			}
		}
	}()
	return hb
}

// stop ends the heartbeat and waits for it.
func (hb *heartbeat) stop() {
	close(hb.quit)
	hb.done.Wait()
	hb.cancel()
}
