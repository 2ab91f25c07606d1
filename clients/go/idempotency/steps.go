package idempotency

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v4"
)

// Multi-step work: a handler of Guard.Do splits its work into named
// steps (Step, StepTx).  Each finished step is checkpointed on the claim
// (Checkpointer); when the handler's process stops and a retry takes the
// key over after the lease, the steps that finished are skipped and return
// the outputs they had, and the rest run.
//
// The recovery point the steps keep is idem's phase and phase_data: phase
// is the name of the step that finished last, phase_data a JSON object
// whose members are the finished steps, in the order they finished, each
// with its output as JSON:
//
//	{"reserve":{"hold":"h-1"},"charge":{"id":"ch_1"}}
//
// Every checkpoint carries the whole object, so each skipped step returns
// its own output.  The Node and Python clients write and read the same
// format.

var (
	// ErrNoSteps: Step or StepTx was called with a context that is not a
	// Guard.Do handler's, or whose guard's store cannot checkpoint.
	ErrNoSteps = errors.New("idempotency: steps need the context of a Guard.Do handler whose store is a Checkpointer")
	// ErrCheckpointData: the key's recovery point is not one that Step
	// wrote (its phase_data is not a JSON object with a member for its
	// phase), so the steps cannot tell which work finished.
	ErrCheckpointData = errors.New("idempotency: the key's recovery point was not written by steps")
)

// StepInfo is what a step gets to pass downstream.
type StepInfo struct {
	Key   string // the idempotency key
	Scope string // the store's scope ("" for the default scope)
	Name  string // the step's name
	Token int64  // the fencing token of this attempt's claim
}

// IdempotencyKey is the key to give a system outside the database for
// this step's call (a payment provider's Idempotency-Key): the scope (when
// not empty), the key and the step's name, joined by ":".
//
// It is the same in every attempt on the key, and that is what keeps a
// charge single across a takeover: when a holder stops after the
// provider charged but before the step's checkpoint, the next holder runs
// the step again and sends the same provider key, and the provider
// answers with the first charge instead of making a second.  A key made
// of the fencing token (key:token) would change with the takeover and
// charge twice.  Token is for fencing: a system that remembers the
// greatest token it has seen for the key refuses a stale holder's late
// call.
func (s StepInfo) IdempotencyKey() string {
	if s.Scope != "" {
		return s.Scope + ":" + s.Key + ":" + s.Name
	}
	return s.Key + ":" + s.Name
}

// Steps is the state of a claim's steps: the recovery point the claim
// started from and the steps finished since.  Guard.Do puts it into its
// handler's context when its store is a Checkpointer; Step and StepTx use
// it.  Run the steps of a handler one after another.
type Steps struct {
	key     string
	scope   string
	token   int64
	store   Checkpointer
	now     func() time.Time
	resumed string
	dataErr error

	mu      sync.Mutex
	names   []string                   // finished steps, in the order they finished
	outputs map[string]json.RawMessage // their outputs
}

type stepsKey struct{}

// newSteps makes the steps of a claim from the recovery point Begin
// returned (phase "" for none).
func newSteps(store Checkpointer, key, scope string, token int64, now func() time.Time, phase string, data []byte) *Steps {
	st := &Steps{key: key, scope: scope, token: token, store: store, now: now, resumed: phase,
		outputs: map[string]json.RawMessage{}}
	if phase == "" {
		return st
	}
	names, outputs, err := decodeSteps(data)
	if err == nil {
		if _, ok := outputs[phase]; !ok {
			err = fmt.Errorf("no member %q for its phase", phase)
		}
	}
	if err != nil {
		st.dataErr = fmt.Errorf("%w: key %q, phase %q: %v", ErrCheckpointData, key, phase, err)
		return st
	}
	st.names, st.outputs = names, outputs
	return st
}

// stepsFinished tells whether ctx's claim has a recovery point: a step
// finished, in this claim or before a takeover.
func stepsFinished(ctx context.Context) bool {
	st, ok := StepsFromContext(ctx)
	if !ok {
		return false
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return len(st.names) > 0 || st.resumed != ""
}

// withSteps returns ctx carrying st.
func withSteps(ctx context.Context, st *Steps) context.Context {
	return context.WithValue(ctx, stepsKey{}, st)
}

// StepsFromContext returns the steps of the claim ctx carries (a Guard.Do
// handler's context with a Checkpointer store).
func StepsFromContext(ctx context.Context) (*Steps, bool) {
	st, ok := ctx.Value(stepsKey{}).(*Steps)
	return st, ok && st != nil
}

// Resumed returns the phase the claim resumed from: the last step that a
// previous holder of the key finished, "" when the claim is new or the
// previous holder finished none.
func (st *Steps) Resumed() string { return st.resumed }

// Done returns the names of the finished steps (the previous holders' and
// this claim's), in the order they finished.
func (st *Steps) Done() []string {
	st.mu.Lock()
	defer st.mu.Unlock()
	return append([]string(nil), st.names...)
}

// finished returns the stored output of step name, if it finished.
func (st *Steps) finished(name string) (json.RawMessage, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	out, ok := st.outputs[name]
	return out, ok
}

// with returns the recovery point's data with step name finished with
// output out, without recording it.
func (st *Steps) with(name string, out json.RawMessage) []byte {
	st.mu.Lock()
	defer st.mu.Unlock()
	names, outputs := st.names, st.outputs
	if _, ok := outputs[name]; !ok {
		names = append(append([]string(nil), names...), name)
	}
	var b bytes.Buffer
	b.WriteByte('{')
	for i, n := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(n)
		b.Write(k)
		b.WriteByte(':')
		if n == name {
			b.Write(out)
		} else {
			b.Write(outputs[n])
		}
	}
	b.WriteByte('}')
	return b.Bytes()
}

// record notes step name as finished with output out.
func (st *Steps) record(name string, out json.RawMessage) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if _, ok := st.outputs[name]; !ok {
		st.names = append(st.names, name)
	}
	st.outputs[name] = out
}

func (st *Steps) info(name string) StepInfo {
	return StepInfo{Key: st.key, Scope: st.scope, Name: name, Token: st.token}
}

// decodeSteps reads a recovery point's data: a JSON object of step names
// and outputs, in order.
func decodeSteps(data []byte) ([]string, map[string]json.RawMessage, error) {
	if data == nil {
		return nil, nil, errors.New("no data")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, nil, err
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, nil, errors.New("not a JSON object")
	}
	var names []string
	outputs := map[string]json.RawMessage{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		name, _ := tok.(string)
		var out json.RawMessage
		if err := dec.Decode(&out); err != nil {
			return nil, nil, err
		}
		if _, ok := outputs[name]; !ok {
			names = append(names, name)
		}
		outputs[name] = out
	}
	if _, err := dec.Token(); err != nil {
		return nil, nil, err
	}
	return names, outputs, nil
}

// stepStart finds the steps of ctx and checks name; skip is the stored
// output when the step finished already.
func stepStart(ctx context.Context, name string) (*Steps, json.RawMessage, bool, error) {
	st, ok := StepsFromContext(ctx)
	if !ok {
		return nil, nil, false, ErrNoSteps
	}
	if name == "" {
		return nil, nil, false, errors.New("idempotency: a step needs a name")
	}
	if st.dataErr != nil {
		return nil, nil, false, st.dataErr
	}
	out, done := st.finished(name)
	return st, out, done, nil
}

// skipped decodes the stored output of a finished step.
func skipped[T any](st *Steps, name string, raw json.RawMessage) (T, error) {
	var out T
	if err := json.Unmarshal(raw, &out); err != nil {
		var zero T
		return zero, fmt.Errorf("%w: key %q, output of step %q: %v", ErrCheckpointData, st.key, name, err)
	}
	return out, nil
}

// Step runs one step of a Guard.Do handler's work, ctx being the
// handler's context.  If step name finished already, in this claim or in
// a previous holder's before a takeover, fn does not run and Step returns
// the output it stored.  Otherwise fn runs with the step's StepInfo (the
// key, the fencing token and IdempotencyKey to pass downstream) and,
// when it succeeds, its output is checkpointed on the claim as the key's
// recovery point (Checkpointer.Checkpoint, in its own transaction) before
// Step returns it.
//
// Step names must be unique within a handler; a step's output must
// survive encoding/json (it is stored as JSON and decoded into T when the
// step is skipped).  fn's error is returned as it is and nothing is
// checkpointed: the step runs again on the next attempt.  A failed
// checkpoint is returned with fn's output (the step ran): ErrSuperseded
// when another caller took the key over, and then the handler should stop,
// since its claim is gone.  A step whose work outside the database may
// have happened without its checkpoint runs again after a takeover: give
// such work StepInfo.IdempotencyKey, so that the system doing it does it
// once.
//
// Steps run one after another.  Without a Checkpointer store, or outside
// a Guard.Do handler (DoTx's handler included: its work commits at once),
// Step returns ErrNoSteps.
func Step[T any](ctx context.Context, name string, fn func(ctx context.Context, step StepInfo) (T, error)) (T, error) {
	var zero T
	st, raw, done, err := stepStart(ctx, name)
	if err != nil {
		return zero, err
	}
	if done {
		return skipped[T](st, name, raw)
	}
	out, err := fn(ctx, st.info(name))
	if err != nil {
		return out, err
	}
	enc, err := json.Marshal(out)
	if err != nil {
		return out, fmt.Errorf("idempotency: output of step %q: %w", name, err)
	}
	if err := st.store.Checkpoint(ctx, st.key, st.token, name, st.with(name, enc), st.now()); err != nil {
		return out, err
	}
	st.record(name, enc)
	return out, nil
}

// StepTx is Step for a step whose work is writes to PostgreSQL: one
// transaction on the store's pool holds the key (idem_hold), runs fn with
// it and checkpoints the step (idem_checkpoint), then commits, so that
// the step's writes and its checkpoint commit together or not at all.
// The guard's store must be a *PostgresStore.
//
// idem_hold checks that this claim still holds the key and keeps a
// takeover waiting until the transaction ends: a holder whose claim was
// taken over gets ErrSuperseded before fn runs, and writes nothing; fn's
// writes commit only while the claim is this one's.  fn's error, or any
// error after it, rolls the transaction back and is returned: the step
// did not happen, and runs again on the next attempt.  An error of the
// commit itself leaves its result unknown: stop the handler then.
//
// The hold is bounded by the store's Timeout and ctx's deadline on the
// server, as the store's calls are; fn's statements run under the
// transaction's own lock_timeout and statement_timeout.
func StepTx[T any](ctx context.Context, name string, fn func(ctx context.Context, tx pgx.Tx, step StepInfo) (T, error)) (T, error) {
	var zero T
	st, raw, done, err := stepStart(ctx, name)
	if err != nil {
		return zero, err
	}
	if done {
		return skipped[T](st, name, raw)
	}
	s, ok := st.store.(*PostgresStore)
	if !ok {
		return zero, fmt.Errorf("%w: StepTx needs a *PostgresStore", ErrNoSteps)
	}
	if err := s.fault("hold"); err != nil {
		return zero, err
	}
	now := st.now()
	// One round trip: BEGIN, the settings bounding the hold, the hold and
	// the transaction's own timeouts put back for fn.
	tx, err := func() (*connTx, error) {
		cctx, cancel := s.callContext(ctx, 0)
		defer cancel()
		var ok bool
		hold := qstmt{stmt: stmt{sql: s.sql(sqlHold), args: []interface{}{st.key, st.token, s.Scope}}, read: scanRow(&ok)}
		tx, err := s.beginTx(cctx, s.boundedStmts(cctx, now, hold))
		return tx, s.mapError(err, fnHold)
	}()
	if err != nil {
		return zero, err
	}
	defer tx.end()
	out, err := fn(ctx, tx, st.info(name))
	if err != nil {
		return out, err
	}
	enc, err := json.Marshal(out)
	if err != nil {
		return out, fmt.Errorf("idempotency: output of step %q: %w", name, err)
	}
	if err := s.fault("checkpoint"); err != nil {
		return out, err
	}
	cctx, cancel := s.callContext(ctx, 0)
	defer cancel()
	// One round trip: the checkpoint and the COMMIT.
	var stored bool
	if err := tx.commitWith(cctx, []qstmt{s.checkpointStmt(st.key, st.token, name, st.with(name, enc), &stored)}); err != nil {
		return out, s.mapError(err, fnCheckpoint)
	}
	st.record(name, enc)
	return out, nil
}
