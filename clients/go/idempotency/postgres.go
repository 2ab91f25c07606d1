package idempotency

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// PostgresStore is a Store backed by the idem extension.
//
// Each Begin is its own short transaction that commits the claim before
// the handler runs; Complete, Release and Extend carry the claim's fencing
// token.  No session state is kept on the server between calls, so the
// store works through transaction pooling (set the pool's statement cache
// to describe mode there).  Set the fields before first use.
type PostgresStore struct {
	// Fault, when set, is called with "begin", "complete", "release",
	// "extend", "checkpoint" or "hold" before each server call; an error
	// fails that call as if the server had not answered.  For tests.
	Fault func(op string) error

	// ClientClock makes every call run at the caller's now: it sets
	// idem.clock_offset (whole seconds, superuser only) for the call's own
	// transaction.  When false, the server's clock decides and now is
	// ignored.
	ClientClock bool

	// Scope is the namespace of the keys (a tenant); "" is the default scope.
	Scope string

	// Schema is the schema of the idem functions; "" means "public".
	Schema string

	// NoWait makes Begin report a claim that is not yet committed as in
	// flight instead of waiting for its transaction.
	NoWait bool

	// Remember is idem_begin's remember (a server with tombstones): how
	// long after its response's retention a completed key is still
	// remembered, so that a retry gets the outcome Expired and never
	// runs again.  0 (the default) does not send it; otherwise it goes as
	// the named argument remember =>, so that a server without it serves
	// every store that leaves it 0.
	Remember time.Duration

	// Timeout bounds each call (0: no bound besides ctx).  It is applied as
	// a context deadline.  A BeginWait (Guard.WaitFor) is bounded by
	// Timeout plus its waitFor, so that the timeout leaves the server's
	// wait its full length.
	//
	// Every call whose context has a deadline (ctx's own, or Timeout's)
	// runs in a transaction with lock_timeout and statement_timeout set to
	// the time left until that deadline, so that a call the client gave up
	// on is also ended on the server: a claim waiting for another
	// transaction's is never made for a caller that has gone, even when
	// the cancel request cannot reach the server.
	Timeout time.Duration

	pool *pgxpool.Pool

	// commitLost, in tests, turns a successful commit of a claim into an
	// error, as when the connection drops before the commit's answer.
	commitLost func() bool
}

// NewPostgresStore returns a store that calls idem through pool.
func NewPostgresStore(pool *pgxpool.Pool) *PostgresStore {
	return &PostgresStore{pool: pool}
}

// Pool returns the pool the store uses.
func (s *PostgresStore) Pool() *pgxpool.Pool { return s.pool }

// extended forces the extended protocol, so bytea bodies go as binary
// parameters even when the pool prefers the simple protocol.
var extended = pgx.QuerySimpleProtocol(false)

const (
	// sqlBegin takes every column of idem_begin and beginRow picks them by
	// name: phase and phase_data (the recovery point a takeover returns)
	// are read where the server has them, and a database whose idem_begin
	// has none serves the rest.
	sqlBegin = "SELECT * FROM %s.idem_begin($1::text, $2::text, $3::interval, $4::interval, $5::text, $6::boolean)"
	// sqlBeginWait passes wait_for too (idem 1.4); only a call that waits
	// uses it, so that a database before 1.4 serves the rest.
	sqlBeginWait = "SELECT * FROM %s.idem_begin($1::text, $2::text, $3::interval, $4::interval, $5::text, $6::boolean, $7::interval)"
	// idem_checkpoint and idem_hold return void: the statements answer true.
	sqlCheckpoint = "SELECT true FROM %s.idem_checkpoint($1::text, $2::bigint, $3::text, $4::bytea, $5::text)"
	sqlHold       = "SELECT true FROM %s.idem_hold($1::text, $2::bigint, $3::text)"
	sqlComplete   = "SELECT %s.idem_complete($1::text, $2::text, $3::integer, $4::bytea, $5::bigint, $6::interval, $7::text)"
	sqlRelease    = "SELECT %s.idem_release($1::text, $2::bigint, $3::text)"
	sqlExtend     = "SELECT %s.idem_extend($1::text, $2::bigint, $3::interval, $4::text)"
	sqlClock      = "SELECT pg_catalog.set_config('idem.clock_offset'," +
		" pg_catalog.round(pg_catalog.date_part('epoch', $1::timestamptz - pg_catalog.clock_timestamp()))::bigint::text, true)"
	// sqlTimeouts bounds the call's transaction by $1, or by the session's
	// own lock_timeout and statement_timeout where they are shorter.
	sqlTimeouts = "SELECT pg_catalog.set_config('lock_timeout', CASE WHEN s.l = '0'" +
		" OR s.l::interval > ($1::text)::interval THEN $1::text ELSE s.l END, true)," +
		" pg_catalog.set_config('statement_timeout', CASE WHEN s.st = '0'" +
		" OR s.st::interval > ($1::text)::interval THEN $1::text ELSE s.st END, true)" +
		" FROM (SELECT pg_catalog.current_setting('lock_timeout') AS l," +
		" pg_catalog.current_setting('statement_timeout') AS st) s"
)

// The functions the statements call, as the errors of a missing one name
// them.
const (
	fnBegin      = "idem_begin(text, text, interval, interval, text, boolean)"
	fnBeginWait  = "idem_begin(text, text, interval, interval, text, boolean, interval)"
	fnComplete   = "idem_complete(text, text, integer, bytea, bigint, interval, text)"
	fnRelease    = "idem_release(text, bigint, text)"
	fnExtend     = "idem_extend(text, bigint, interval, text)"
	fnCheckpoint = "idem_checkpoint(text, bigint, text, bytea, text)"
	fnHold       = "idem_hold(text, bigint, text)"
)

// schema is the quoted schema of the idem functions.
func (s *PostgresStore) schema() string {
	schema := s.Schema
	if schema == "" {
		schema = "public"
	}
	return pgx.Identifier{schema}.Sanitize()
}

// sql puts the quoted schema into a statement.
func (s *PostgresStore) sql(format string) string {
	return fmt.Sprintf(format, s.schema())
}

// mapError is the package's mapError, with a missing function or schema
// named: fn is the function the call looked for.
func (s *PostgresStore) mapError(err error, fn string) error {
	return missingError(err, s.schema(), fn)
}

func (s *PostgresStore) fault(op string) error {
	if s.Fault != nil {
		return s.Fault(op)
	}
	return nil
}

// callContext bounds one call by Timeout plus the wait it may take in the
// server.
func (s *PostgresStore) callContext(ctx context.Context, wait time.Duration) (context.Context, context.CancelFunc) {
	if s.Timeout > 0 {
		return context.WithTimeout(ctx, s.Timeout+wait)
	}
	return context.WithCancel(ctx)
}

// interval is d as an interval parameter; 0 is NULL (the server's default).
func interval(d time.Duration) interface{} {
	if d == 0 {
		return nil
	}
	return d
}

// serverTimeout is the lock_timeout and statement_timeout that end a
// call on the server by ctx's deadline (callContext puts Timeout there);
// "" when ctx has none.
func serverTimeout(ctx context.Context) string {
	deadline, ok := ctx.Deadline()
	if !ok {
		return ""
	}
	ms := int64(math.Ceil(float64(time.Until(deadline)) / float64(time.Millisecond)))
	if ms < 1 {
		ms = 1 // 0 would be no timeout at all
	}
	return fmt.Sprintf("%dms", ms)
}

// locals are the statements that apply the clock offset and the timeouts
// of ctx's deadline to a transaction.
func (s *PostgresStore) locals(ctx context.Context, now time.Time) []stmt {
	var pre []stmt
	if s.ClientClock {
		pre = append(pre, stmt{sql: sqlClock, args: []interface{}{now}})
	}
	if timeout := serverTimeout(ctx); timeout != "" {
		pre = append(pre, stmt{sql: sqlTimeouts, args: []interface{}{timeout}})
	}
	return pre
}

// setLocals applies the clock offset and the timeouts of ctx's deadline
// to tx.
func (s *PostgresStore) setLocals(ctx context.Context, tx pgx.Tx, now time.Time) error {
	for _, st := range s.locals(ctx, now) {
		if err := st.run(ctx, tx); err != nil {
			return err
		}
	}
	return nil
}

// needsTx tells whether a call with ctx must run in an explicit
// transaction: to move the clock, or to bound its wait on the server.
func (s *PostgresStore) needsTx(ctx context.Context) bool {
	_, deadline := ctx.Deadline()
	return s.ClientClock || deadline
}

// rollback ends tx if it is still open; a broken connection is dropped by
// the pool.
func rollback(tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(ctx)
}

// runner is what statements run on: the pool, a pgx.Tx or a connection.
type runner interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	Exec(ctx context.Context, sql string, args ...interface{}) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...interface{}) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...interface{}) pgx.Row
}

// call runs one statement in one round trip: alone on the pool, or, when
// the clock offset or ctx's deadline must apply, in one batch after the
// statements that set them (an implicit transaction that commits at the
// batch's end; see oneTrip).
func (s *PostgresStore) call(ctx context.Context, now time.Time, st qstmt) error {
	if !s.needsTx(ctx) {
		return s.oneTrip(ctx, []qstmt{st})
	}
	return s.oneTrip(ctx, append(s.localStmts(ctx, now), st))
}

// scanRow is a read that scans a statement's one row into dest.
func scanRow(dest ...interface{}) func(pgx.Rows) error {
	return func(rows pgx.Rows) error {
		if !rows.Next() {
			if err := rows.Err(); err != nil {
				return err
			}
			return pgx.ErrNoRows
		}
		if err := rows.Scan(dest...); err != nil {
			return err
		}
		rows.Close()
		return rows.Err()
	}
}

// beginCall is the idem_begin statement for a claim, the function it
// calls (for the error of a missing one) and its arguments.  wait > 0
// calls the form with wait_for.
func (s *PostgresStore) beginCall(key, fingerprint string, lease, retention, wait time.Duration) (string, string, []interface{}) {
	args := []interface{}{key, fingerprint, interval(lease), interval(retention), s.Scope, !s.NoWait}
	sql, fn := s.sql(sqlBegin), fnBegin
	if wait > 0 {
		sql, fn, args = s.sql(sqlBeginWait), fnBeginWait, append(args, wait)
	}
	if s.Remember > 0 {
		args = append(args, s.Remember)
		sql = strings.TrimSuffix(sql, ")") + fmt.Sprintf(", remember => $%d::interval)", len(args))
		fn = strings.TrimSuffix(fn, ")") + ", remember interval)"
	}
	return sql, fn, args
}

// claimStmt is the idem_begin statement of a claim; its answer lands in
// rec and claimed.  fn is the function it calls, for the error of a
// missing one.
func (s *PostgresStore) claimStmt(key, fingerprint string, lease, retention, wait time.Duration, rec *Record, claimed *bool) (qstmt, string) {
	sql, fn, args := s.beginCall(key, fingerprint, lease, retention, wait)
	return qstmt{stmt: stmt{sql: sql, args: args}, read: func(rows pgx.Rows) error {
		var err error
		*rec, *claimed, err = scanBegin(rows, fingerprint)
		return err
	}}, fn
}

// stmt is a statement that prepares a transaction for a call: its SQL,
// its arguments and where its row is scanned (nil: the row is dropped).
type stmt struct {
	sql  string
	args []interface{}
	dest []interface{}
}

// run runs st on q alone.
func (st stmt) run(ctx context.Context, q runner) error {
	args := append([]interface{}{extended}, st.args...)
	if st.dest != nil {
		return q.QueryRow(ctx, st.sql, args...).Scan(st.dest...)
	}
	_, err := q.Exec(ctx, st.sql, args...)
	return err
}

// errRow is a row that fails with err.
type errRow struct{ err error }

func (r errRow) Scan(...interface{}) error { return r.err }

// scanBegin makes the row of idem_begin a Record.
func scanBegin(rows pgx.Rows, fingerprint string) (Record, bool, error) {
	var (
		claimed               bool
		state                 string
		token                 *int64
		status                *int32
		body                  []byte
		leaseUntil, expiresAt *time.Time
		phase                 *string
		phaseData             []byte
	)
	defer rows.Close()
	// The columns by name; one this client does not know is skipped.
	byName := map[string]interface{}{
		"claimed": &claimed, "state": &state, "token": &token, "status": &status, "body": &body,
		"lease_until": &leaseUntil, "expires_at": &expiresAt, "phase": &phase, "phase_data": &phaseData,
	}
	fields := rows.FieldDescriptions()
	dest := make([]interface{}, len(fields))
	for i, f := range fields {
		dest[i] = byName[string(f.Name)]
	}
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return Record{}, false, err
		}
		return Record{}, false, errors.New("idem_begin returned no row")
	}
	if err := rows.Scan(dest...); err != nil {
		return Record{}, false, err
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return Record{}, false, err
	}
	rec := Record{Fingerprint: fingerprint, State: State(state)}
	if rec.State == Conflict {
		rec.Fingerprint = ""
	}
	if status != nil {
		rec.Response.Status = int(*status)
	}
	if body != nil {
		rec.Response.Body = append([]byte{}, body...)
	}
	if leaseUntil != nil {
		rec.LeaseUntil = *leaseUntil
	}
	if expiresAt != nil {
		rec.ExpiresAt = *expiresAt
	}
	if claimed {
		if token == nil {
			return Record{}, false, errors.New("idem_begin claimed a key without a token")
		}
		rec.Token = *token
		if phase != nil && *phase != "" {
			rec.Phase = *phase
			if phaseData != nil {
				rec.PhaseData = append([]byte{}, phaseData...)
			}
		}
	}
	return rec, claimed, nil
}

// Begin claims key with idem_begin in its own transaction.  lease or
// retention 0 means the server's default (idem.default_lease,
// idem.default_retention).  If the claim's commit fails or is cut off
// (timeout, lost connection), the claim is released at once so that no
// claim is left that nobody holds.
func (s *PostgresStore) Begin(ctx context.Context, key, fingerprint string, now time.Time, lease, retention time.Duration) (Record, bool, error) {
	return s.BeginWait(ctx, key, fingerprint, now, lease, retention, 0)
}

// BeginWait is Begin that waits in the server up to waitFor for a key in
// flight (see Waiter): it calls idem_begin with wait_for (idem 1.4).  With
// waitFor 0 it passes no wait_for, as Begin does, and works with idem
// before 1.4.  The server ends the wait at waitFor; Timeout bounds the
// call at Timeout + waitFor, and ctx's deadline must be later than
// waitFor, or the wait is cancelled (57014).  Waiting needs NoWait false:
// the server refuses NoWait with a wait (22023).
func (s *PostgresStore) BeginWait(ctx context.Context, key, fingerprint string, now time.Time, lease, retention, waitFor time.Duration) (Record, bool, error) {
	if err := s.fault("begin"); err != nil {
		return Record{}, false, err
	}
	if waitFor < 0 {
		waitFor = 0
	}
	cctx, cancel := s.callContext(ctx, waitFor)
	defer cancel()
	var (
		rec     Record
		claimed bool
	)
	// One round trip: the settings and the claim in one batch, an
	// implicit transaction that commits at its end.
	claim, fn := s.claimStmt(key, fingerprint, lease, retention, waitFor, &rec, &claimed)
	err := s.oneTrip(cctx, append(s.localStmts(cctx, now), claim))
	if err == nil && s.commitLost != nil && s.commitLost() {
		err = errors.New("commit answer lost")
	}
	if err != nil {
		if claimed {
			s.releaseQuietly(key, rec.Token, now)
		}
		return Record{}, false, s.mapError(err, fn)
	}
	return rec, claimed, nil
}

// releaseQuietly gives up a claim whose commit may or may not have happened.
func (s *PostgresStore) releaseQuietly(key string, token int64, now time.Time) {
	d := s.Timeout
	if d < 5*time.Second {
		d = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var ok bool
	_ = s.call(ctx, now, qstmt{stmt: stmt{sql: s.sql(sqlRelease), args: []interface{}{key, token, s.Scope}}, read: scanRow(&ok)})
}

// Complete stores resp with idem_complete.  The token is that of the claim
// of key that ctx carries (see WithClaim; Guard.Do puts it there); without
// one the server accepts the complete only inside the claiming transaction.
// retention 0 means the server's default.
func (s *PostgresStore) Complete(ctx context.Context, key, fingerprint string, resp Response, now time.Time, retention time.Duration) error {
	if err := s.fault("complete"); err != nil {
		return err
	}
	var token interface{}
	if t, ok := tokenFor(ctx, key); ok {
		token = t
	}
	cctx, cancel := s.callContext(ctx, 0)
	defer cancel()
	var expires time.Time
	return s.mapError(s.call(cctx, now, s.completeStmt(key, fingerprint, resp, token, retention, &expires)), fnComplete)
}

// completeStmt is the idem_complete statement; its answer lands in expires.
func (s *PostgresStore) completeStmt(key, fingerprint string, resp Response, token interface{}, retention time.Duration, expires *time.Time) qstmt {
	return qstmt{stmt: stmt{sql: s.sql(sqlComplete), args: []interface{}{key, fingerprint, int32(resp.Status),
		body(resp.Body), token, interval(retention), s.Scope}}, read: scanRow(expires)}
}

// body is never NULL: a nil body is stored as an empty one.
func body(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// Release gives up the claim of key held with token (idem_release), so
// that the key is free at once.  It returns false when the key has no live
// row.
func (s *PostgresStore) Release(ctx context.Context, key string, token int64, now time.Time) (bool, error) {
	if err := s.fault("release"); err != nil {
		return false, err
	}
	cctx, cancel := s.callContext(ctx, 0)
	defer cancel()
	var released bool
	err := s.call(cctx, now, qstmt{stmt: stmt{sql: s.sql(sqlRelease), args: []interface{}{key, token, s.Scope}}, read: scanRow(&released)})
	return released, s.mapError(err, fnRelease)
}

// Extend moves the lease of the claim of key held with token to now +
// lease (idem_extend; lease 0: the server's default lease) and returns
// the new end of the lease.
func (s *PostgresStore) Extend(ctx context.Context, key string, token int64, now time.Time, lease time.Duration) (time.Time, error) {
	if err := s.fault("extend"); err != nil {
		return time.Time{}, err
	}
	cctx, cancel := s.callContext(ctx, 0)
	defer cancel()
	var until time.Time
	err := s.call(cctx, now, qstmt{stmt: stmt{sql: s.sql(sqlExtend), args: []interface{}{key, token, interval(lease), s.Scope}}, read: scanRow(&until)})
	return until, s.mapError(err, fnExtend)
}

// Checkpoint stores phase and data as the recovery point of the claim of
// key held with token, with idem_checkpoint in its own transaction (see
// Checkpointer).  A token that was superseded gets ErrSuperseded, a key
// without a live claim ErrNoClaim, a completed key ErrAlreadyCompleted
// (as *Error); a claim of another role 42501, an empty phase 22023 and
// data larger than idem.max_body_size 54000 (as *pgconn.PgError).
func (s *PostgresStore) Checkpoint(ctx context.Context, key string, token int64, phase string, data []byte, now time.Time) error {
	if err := s.fault("checkpoint"); err != nil {
		return err
	}
	cctx, cancel := s.callContext(ctx, 0)
	defer cancel()
	var ok bool
	return s.mapError(s.call(cctx, now, s.checkpointStmt(key, token, phase, data, &ok)), fnCheckpoint)
}

// checkpointStmt is the idem_checkpoint statement; it answers true in ok.
func (s *PostgresStore) checkpointStmt(key string, token int64, phase string, data []byte, ok *bool) qstmt {
	var d interface{}
	if data != nil {
		d = data
	}
	return qstmt{stmt: stmt{sql: s.sql(sqlCheckpoint), args: []interface{}{key, token, phase, d, s.Scope}}, read: scanRow(ok)}
}

// DoTx runs fn under key in one transaction with fn's own writes: it
// claims the key with idem_begin, runs fn with the transaction, stores the
// response with idem_complete and commits.  The claim, fn's writes and the
// response commit together or not at all; a concurrent retry waits for the
// transaction and then replays the response.
//
// g.Store must be a *PostgresStore.  The outcomes are those of Do.  Any
// error after the claim (from fn, the complete or the commit) rolls the
// transaction back: the outcome is Executed with that error, and neither
// fn's writes nor the claim remain (unless the commit itself was cut off,
// when its result is unknown).  A complete the server refuses for good
// rolls back too, and is not replaced by NotStoredResponse as in Do: with
// fn's writes undone, a retry may run fn again.  The handler's context
// carries the claim (WithClaim).  Lease, Heartbeat and ReleaseOnError do
// not apply.
//
// A retry waits for a claim that is not yet committed in any case; with
// WaitFor, it also waits up to WaitFor for a committed claim in flight (one
// that Do made), as Do does.
//
// With TxRetries > 0, a transaction that fails with a serialization
// failure (40001) or a deadlock (40P01) runs again, as a new transaction,
// up to TxRetries more times: from the claim (which the rollback undid
// with fn's writes, so the key is claimed again, or replayed if another
// caller completed it meanwhile), through fn, to the commit.  An error
// from the claim, fn (wrapped or not: errors.As finds the
// *pgconn.PgError), the complete or the COMMIT counts; PostgreSQL rolls a
// transaction back when it answers COMMIT with 40001 or 40P01, so nothing
// of it was committed.  An error without a SQLSTATE (a lost connection, a
// commit cut off, whose result is unknown) or with any other SQLSTATE is
// never retried.  Between attempts DoTx sleeps a random time between 0 and
// 10 ms doubled for each retry, at most 1 s ("full jitter"); it gives up,
// returning the last error, when ctx is done or its deadline would pass
// during that sleep.  The last attempt's result is returned.  fn must be
// safe to run again in a new transaction: its only effects must be its
// statements on tx, which the rollback undoes (no call to another system,
// no message sent).
func (g *Guard) DoTx(ctx context.Context, key, fingerprint string, fn func(context.Context, pgx.Tx) (Response, error)) (Response, Outcome, error) {
	s, ok := g.Store.(*PostgresStore)
	if !ok {
		return Response{}, Unavailable, fmt.Errorf("%w: DoTx needs a *PostgresStore", ErrUnavailable)
	}
	for retry := 0; ; retry++ {
		resp, out, err := g.doTx(ctx, s, key, fingerprint, fn)
		if err == nil || retry >= g.TxRetries || !retryableTx(err) || !txBackoff(ctx, retry) {
			return resp, out, err
		}
	}
}

// doTx is one attempt of DoTx: one transaction, rolled back unless it
// commits.
func (g *Guard) doTx(ctx context.Context, s *PostgresStore, key, fingerprint string, fn func(context.Context, pgx.Tx) (Response, error)) (Response, Outcome, error) {
	now := g.now()
	if err := s.fault("begin"); err != nil {
		return Response{}, Unavailable, unavailable(err)
	}
	wait := g.WaitFor
	if wait < 0 {
		wait = 0
	}
	// One round trip: BEGIN, the settings bounding the claim, the claim,
	// and the transaction's own timeouts put back for the handler.
	var (
		rec     Record
		claimed bool
	)
	tx, err := func() (*connTx, error) {
		cctx, cancel := s.callContext(ctx, wait)
		defer cancel()
		claim, fn := s.claimStmt(key, fingerprint, g.Lease, g.Retention, wait, &rec, &claimed)
		tx, err := s.beginTx(cctx, s.boundedStmts(cctx, now, claim))
		return tx, s.mapError(err, fn)
	}()
	if err != nil {
		return Response{}, Unavailable, unavailable(err)
	}
	defer tx.end()
	if !claimed {
		// The second round trip ends the transaction.
		_ = tx.Rollback(ctx)
		return answer(rec)
	}
	resp, ferr := fn(WithClaim(ctx, Claim{Key: key, Token: rec.Token}), tx)
	if ferr != nil {
		return resp, Executed, ferr
	}
	if err := s.fault("complete"); err != nil {
		return resp, Executed, err
	}
	cctx, cancel := s.callContext(ctx, 0)
	defer cancel()
	// One round trip: the complete and the COMMIT.
	var expires time.Time
	if err := tx.commitWith(cctx, []qstmt{s.completeStmt(key, fingerprint, resp, rec.Token, g.Retention, &expires)}); err != nil {
		return resp, Executed, s.mapError(err, fnComplete)
	}
	return resp, Executed, nil
}
