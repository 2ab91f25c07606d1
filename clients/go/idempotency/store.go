// Package idempotency guards mutating requests with idempotency keys.
//
// A Guard claims a key in a Store, runs the handler once, stores its
// response and replays that response to retries.  MemoryStore keeps keys in
// process memory (for unit tests); PostgresStore keeps them in PostgreSQL
// through the idem extension, so that every process sharing the database
// shares the keys.
package idempotency

import (
	"context"
	"errors"
	"sync"
	"time"
)

// State is the state of a key as Begin reports it.
type State string

const (
	Processing State = "PROCESSING"
	Done       State = "DONE"
	Conflict   State = "CONFLICT"
	// ResponseExpired is the state of a key that a server with tombstones
	// (idem_begin's remember, PostgresStore.Remember) still remembers after
	// its response's retention: the request was executed and completed
	// once, its response is gone (Record.Response carries the status
	// alone), and it must never execute again.
	ResponseExpired State = "EXPIRED"
)

var (
	ErrInFlight = errors.New("idempotent request is in flight")
	ErrConflict = errors.New("idempotency key reused with different parameters")
	// ErrExpired is the error of the outcome Expired.
	ErrExpired = errors.New("idempotent request completed before; its response is no longer kept")
)

// Response is what a handler answered and what a retry replays.
type Response struct {
	Status int
	Body   []byte
}

// Record is a key as Begin found or made it.
//
// Token is the claim's fencing token when Begin claimed the key (0
// otherwise).  PostgresStore does not learn the stored fingerprint of a
// key used with another one: on Conflict, Fingerprint is empty.
//
// Phase and PhaseData are the recovery point of the key, its last
// checkpoint (see Checkpointer), when Begin claimed it by taking over a
// claim whose lease had ended: "" and nil for a new claim, for a claim
// that had no checkpoint and whenever Begin did not claim.
type Record struct {
	Fingerprint string
	State       State
	Response    Response
	LeaseUntil  time.Time
	ExpiresAt   time.Time
	Token       int64
	Phase       string
	PhaseData   []byte
}

// Store claims keys and stores responses.
//
// Begin claims key (claimed true) when it is new, its window is over or its
// lease is over; otherwise it reports the record.  Complete stores the
// response of a claim; the claim's token travels in ctx (see WithClaim).
type Store interface {
	Begin(ctx context.Context, key, fingerprint string, now time.Time, lease, retention time.Duration) (Record, bool, error)
	Complete(ctx context.Context, key, fingerprint string, resp Response, now time.Time, retention time.Duration) error
}

// Waiter is a Store whose Begin can wait for a key in flight instead of
// reporting it at once.  When key is held by another caller's claim whose
// lease is live, BeginWait waits up to waitFor until the first of: the
// holder completes (the record is Done: replay), the holder releases or
// its lease ends (BeginWait claims the key), or waitFor passes (in flight,
// with LeaseUntil telling when the holder's lease ends).  waitFor 0 is
// Begin.  Guard.Do and Guard.DoTx call it when Guard.WaitFor is set.
type Waiter interface {
	BeginWait(ctx context.Context, key, fingerprint string, now time.Time, lease, retention, waitFor time.Duration) (Record, bool, error)
}

// Releaser is a Store that can give up a claim so that a retry may run at
// once.  It reports whether a claim was released.
type Releaser interface {
	Release(ctx context.Context, key string, token int64, now time.Time) (bool, error)
}

// Extender is a Store that can move a claim's lease to now + lease.
// It returns the new end of the lease.
type Extender interface {
	Extend(ctx context.Context, key string, token int64, now time.Time, lease time.Duration) (time.Time, error)
}

// Checkpointer is a Store that keeps a recovery point on a claim: the
// last phase of the work that finished, and its data.  A Begin that takes
// the key over after the lease ended returns it (Record.Phase,
// Record.PhaseData), so that the new holder resumes where the old one
// stopped; a later checkpoint replaces the earlier one and a completion
// drops it.  Checkpoint is fenced like Complete: a token that was
// superseded gets ErrSuperseded, a key without a live claim ErrNoClaim, a
// completed key ErrAlreadyCompleted.  MemoryStore and PostgresStore (idem
// 1.4, idem_checkpoint) are Checkpointers; Step and StepTx use it.
type Checkpointer interface {
	Checkpoint(ctx context.Context, key string, token int64, phase string, data []byte, now time.Time) error
}

// Claim identifies the claim a handler runs under.
type Claim struct {
	Key   string
	Token int64
}

type claimKey struct{}

// WithClaim returns ctx carrying claim.  Guard.Do gives it to the handler
// and to Store.Complete; PostgresStore.Complete sends the token of the
// claim whose Key is the key being completed.
func WithClaim(ctx context.Context, claim Claim) context.Context {
	return context.WithValue(ctx, claimKey{}, claim)
}

// ClaimFromContext returns the claim ctx carries.
func ClaimFromContext(ctx context.Context) (Claim, bool) {
	c, ok := ctx.Value(claimKey{}).(Claim)
	return c, ok
}

// TokenFromContext returns the fencing token of the claim ctx carries.
// Pass it downstream (to a payment provider, a queue) so that a stale
// holder's late writes can be refused there too.
func TokenFromContext(ctx context.Context) (int64, bool) {
	c, ok := ClaimFromContext(ctx)
	return c.Token, ok
}

// tokenFor returns the token ctx carries for key.
func tokenFor(ctx context.Context, key string) (int64, bool) {
	c, ok := ClaimFromContext(ctx)
	if !ok || c.Key != key {
		return 0, false
	}
	return c.Token, true
}

// MemoryStore keeps keys in a map.  It is for tests and single-process
// programs: nothing is shared between processes and nothing survives a
// restart.
type MemoryStore struct {
	mu        sync.Mutex
	records   map[string]Record
	lastToken int64
	// changed is closed, and cleared, when a key is completed or released:
	// callers waiting in BeginWait then look again.
	changed chan struct{}
	// waiting counts the callers waiting in BeginWait.
	waiting int
	// Fault, when set, is called with "begin", "complete", "release",
	// "extend" or "checkpoint" before each operation; an error fails that
	// operation.
	Fault func(op string) error
}

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore() *MemoryStore { return &MemoryStore{records: map[string]Record{}} }

func (s *MemoryStore) fault(op string) error {
	if s.Fault != nil {
		return s.Fault(op)
	}
	return nil
}

// Begin claims key or reports it; see Store.
func (s *MemoryStore) Begin(ctx context.Context, key, fingerprint string, now time.Time, lease, retention time.Duration) (Record, bool, error) {
	return s.BeginWait(ctx, key, fingerprint, now, lease, retention, 0)
}

// BeginWait is Begin that waits up to waitFor for a key in flight; see
// Waiter.  The store's clock is the caller's now moved on by the time
// waited, so a lease that ends during the wait lets this call claim the
// key.  A cancelled ctx ends the wait with ctx's error.
func (s *MemoryStore) BeginWait(ctx context.Context, key, fingerprint string, now time.Time, lease, retention, waitFor time.Duration) (Record, bool, error) {
	start := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.fault("begin"); err != nil {
		return Record{}, false, err
	}
	var waited time.Duration
	for {
		at := now.Add(waited)
		rec, claimed := s.begin(key, fingerprint, at, lease, retention)
		left := waitFor - waited
		if claimed || rec.State != Processing || left <= 0 {
			return rec, claimed, nil
		}
		if untilFree := rec.LeaseUntil.Sub(at); untilFree < left {
			left = untilFree
		}
		if s.changed == nil {
			s.changed = make(chan struct{})
		}
		changed := s.changed
		s.waiting++
		s.mu.Unlock()
		timer := time.NewTimer(left)
		select {
		case <-changed:
		case <-timer.C:
		case <-ctx.Done():
		}
		timer.Stop()
		s.mu.Lock()
		s.waiting--
		if err := ctx.Err(); err != nil {
			return Record{}, false, err
		}
		waited = time.Since(start)
	}
}

// begin claims key at now or reports it.
func (s *MemoryStore) begin(key, fingerprint string, now time.Time, lease, retention time.Duration) (Record, bool) {
	rec, ok := s.records[key]
	if !ok || !now.Before(rec.ExpiresAt) {
		s.lastToken++
		rec = Record{Fingerprint: fingerprint, State: Processing, LeaseUntil: now.Add(lease),
			ExpiresAt: now.Add(retention), Token: s.lastToken}
		s.records[key] = rec
		return rec, true
	}
	if rec.Fingerprint != fingerprint {
		rec.State = Conflict
		rec.Token = 0
		rec.Phase, rec.PhaseData = "", nil
		return rec, false
	}
	if rec.State == Done || now.Before(rec.LeaseUntil) {
		rec.Token = 0
		rec.Phase, rec.PhaseData = "", nil
		return rec, false
	}
	// A takeover: the recovery point stays on the key (a holder that
	// stops before its first checkpoint leaves it to the next) and goes
	// to the new holder.
	s.lastToken++
	rec.LeaseUntil = now.Add(lease)
	rec.Token = s.lastToken
	s.records[key] = rec
	rec.PhaseData = append([]byte(nil), rec.PhaseData...)
	if rec.Phase == "" {
		rec.PhaseData = nil
	}
	return rec, true
}

// wake lets the callers waiting in BeginWait look again.
func (s *MemoryStore) wake() {
	if s.changed != nil {
		close(s.changed)
		s.changed = nil
	}
}

// Complete stores resp for key.  A key that is missing or has another
// fingerprint gets ErrConflict; when ctx carries a claim of key whose token
// was superseded by a takeover, ErrSuperseded.
func (s *MemoryStore) Complete(ctx context.Context, key, fingerprint string, resp Response, now time.Time, retention time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.fault("complete"); err != nil {
		return err
	}
	rec, ok := s.records[key]
	if !ok || rec.Fingerprint != fingerprint {
		return ErrConflict
	}
	if token, has := tokenFor(ctx, key); has && token != rec.Token {
		return ErrSuperseded
	}
	rec.State = Done
	rec.Phase, rec.PhaseData = "", nil
	rec.Response = Response{Status: resp.Status, Body: append([]byte(nil), resp.Body...)}
	rec.LeaseUntil = time.Time{}
	rec.ExpiresAt = now.Add(retention)
	s.records[key] = rec
	s.wake()
	return nil
}

// Release deletes the claim of key held with token.
func (s *MemoryStore) Release(ctx context.Context, key string, token int64, now time.Time) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.fault("release"); err != nil {
		return false, err
	}
	rec, ok := s.records[key]
	switch {
	case !ok || !now.Before(rec.ExpiresAt):
		return false, nil
	case rec.State == Done:
		return false, ErrAlreadyCompleted
	case rec.Token != token:
		return false, ErrSuperseded
	}
	delete(s.records, key)
	s.wake()
	return true, nil
}

// Extend moves the lease of the claim of key held with token to now + lease.
func (s *MemoryStore) Extend(ctx context.Context, key string, token int64, now time.Time, lease time.Duration) (time.Time, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.fault("extend"); err != nil {
		return time.Time{}, err
	}
	rec, ok := s.records[key]
	switch {
	case !ok || !now.Before(rec.ExpiresAt):
		return time.Time{}, ErrNoClaim
	case rec.State == Done:
		return time.Time{}, ErrAlreadyCompleted
	case rec.Token != token:
		return time.Time{}, ErrSuperseded
	}
	rec.LeaseUntil = now.Add(lease)
	if rec.ExpiresAt.Before(rec.LeaseUntil) {
		rec.ExpiresAt = rec.LeaseUntil
	}
	s.records[key] = rec
	return rec.LeaseUntil, nil
}

// Checkpoint stores phase and data as the recovery point of the claim of
// key held with token; see Checkpointer.  An empty phase is refused.
func (s *MemoryStore) Checkpoint(ctx context.Context, key string, token int64, phase string, data []byte, now time.Time) error {
	if phase == "" {
		return errors.New("idempotency: checkpoint needs a phase")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.fault("checkpoint"); err != nil {
		return err
	}
	rec, ok := s.records[key]
	switch {
	case !ok || !now.Before(rec.ExpiresAt):
		return ErrNoClaim
	case rec.State == Done:
		return ErrAlreadyCompleted
	case rec.Token != token:
		return ErrSuperseded
	}
	rec.Phase = phase
	rec.PhaseData = append([]byte(nil), data...)
	s.records[key] = rec
	return nil
}
