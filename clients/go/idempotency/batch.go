package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

// Item is one request of a batch: its key and fingerprint.
type Item struct {
	Key         string
	Fingerprint string
}

// Result is what DoMany or DoManyTx did with one item of a batch: the
// outcome, response and error Do would have returned for it.
//
// DuplicateOf is the position in the batch of the item's first
// occurrence when the same key came earlier in the batch, -1 otherwise.
// A duplicate with the same fingerprint gets its first occurrence's
// result (its handler does not run again); with another fingerprint it
// is Conflicted with ErrConflict.
type Result struct {
	Response    Response
	Outcome     Outcome
	Err         error
	DuplicateOf int
}

// State the server answers for a later occurrence of a key in one batch.
const duplicateState = "DUPLICATE"

// manyRow is one row of idem_begin_many.
type manyRow struct {
	rec     Record
	claimed bool
	dupOf   int // 0-based; -1 when the key is not a repeat
}

const (
	sqlBeginMany = "SELECT ordinality, claimed, state, token, status, body, lease_until, expires_at," +
		" phase, phase_data, duplicate_of FROM %s.idem_begin_many($1::text[], $2::text[], $3::interval," +
		" $4::interval, $5::text, $6::boolean, $7::interval, $8::interval)"
	sqlCompleteMany = "SELECT ordinality FROM %s.idem_complete_many($1::text[], $2::text[], $3::integer[]," +
		" $4::bytea[], $5::bigint[], $6::interval, $7::text)"
	sqlReleaseMany = "SELECT %s.idem_release(u.k, u.t, $3::text) FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::bigint[])) AS u(k, t)"

	fnBeginMany    = "idem_begin_many(text[], text[], interval, interval, text, boolean, interval, interval, text)"
	fnCompleteMany = "idem_complete_many(text[], text[], integer[], bytea[], bigint[], interval, text)"
	fnFinishMany   = fnCompleteMany + " or " + fnRelease
)

// beginManyStmt is the idem_begin_many statement of a batch; its rows
// land in out.
func (s *PostgresStore) beginManyStmt(items []Item, lease, retention, wait time.Duration, out *[]manyRow) qstmt {
	keys := make([]string, len(items))
	fps := make([]string, len(items))
	for i, it := range items {
		keys[i], fps[i] = it.Key, it.Fingerprint
	}
	var waitFor, remember interface{}
	if wait > 0 {
		waitFor = wait
	}
	if s.Remember > 0 {
		remember = s.Remember
	}
	return qstmt{
		stmt: stmt{sql: s.sql(sqlBeginMany), args: []interface{}{keys, fps, interval(lease), interval(retention),
			s.Scope, !s.NoWait, waitFor, remember}},
		read: func(rows pgx.Rows) error {
			res, err := scanMany(rows, items)
			*out = res
			return err
		},
	}
}

// scanMany reads the rows of idem_begin_many, one per item.
func scanMany(rows pgx.Rows, items []Item) ([]manyRow, error) {
	res := make([]manyRow, len(items))
	seen := make([]bool, len(items))
	for rows.Next() {
		var (
			ord                   int32
			claimed               *bool
			state                 string
			token                 *int64
			status                *int32
			body                  []byte
			leaseUntil, expiresAt *time.Time
			phase                 *string
			phaseData             []byte
			dup                   *int32
		)
		if err := rows.Scan(&ord, &claimed, &state, &token, &status, &body, &leaseUntil, &expiresAt,
			&phase, &phaseData, &dup); err != nil {
			return nil, err
		}
		i := int(ord) - 1
		if i < 0 || i >= len(items) || seen[i] {
			return nil, fmt.Errorf("idem_begin_many answered item %d of %d twice or out of range", ord, len(items))
		}
		seen[i] = true
		r := manyRow{rec: Record{Fingerprint: items[i].Fingerprint, State: State(state)}, dupOf: -1}
		if dup != nil {
			r.dupOf = int(*dup) - 1
		}
		if r.rec.State == Conflict {
			r.rec.Fingerprint = ""
		}
		if status != nil {
			r.rec.Response.Status = int(*status)
		}
		if body != nil {
			r.rec.Response.Body = append([]byte{}, body...)
		}
		if leaseUntil != nil {
			r.rec.LeaseUntil = *leaseUntil
		}
		if expiresAt != nil {
			r.rec.ExpiresAt = *expiresAt
		}
		if claimed != nil && *claimed {
			if token == nil {
				return nil, errors.New("idem_begin_many claimed a key without a token")
			}
			r.claimed = true
			r.rec.Token = *token
			if phase != nil && *phase != "" {
				r.rec.Phase = *phase
				r.rec.PhaseData = append([]byte{}, phaseData...)
			}
		}
		res[i] = r
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	for i, ok := range seen {
		if !ok {
			return nil, fmt.Errorf("idem_begin_many answered no row for item %d", i+1)
		}
	}
	return res, nil
}

// finishStmts are the statements that end a batch: idem_complete_many for
// the items in done (their responses in resps, their tokens in toks) and
// idem_release for the claims in failed.  Either may be empty.
func (s *PostgresStore) finishStmts(items []Item, rows []manyRow, done, failed []int, resps []Response, retention time.Duration) []qstmt {
	var out []qstmt
	if len(done) > 0 {
		keys := make([]string, len(done))
		fps := make([]string, len(done))
		statuses := make([]int32, len(done))
		bodies := make([][]byte, len(done))
		tokens := make([]int64, len(done))
		for j, i := range done {
			keys[j], fps[j] = items[i].Key, items[i].Fingerprint
			statuses[j], bodies[j] = int32(resps[i].Status), body(resps[i].Body)
			tokens[j] = rows[i].rec.Token
		}
		out = append(out, qstmt{stmt: stmt{sql: s.sql(sqlCompleteMany),
			args: []interface{}{keys, fps, statuses, bodies, tokens, interval(retention), s.Scope}},
			read: drain})
	}
	if len(failed) > 0 {
		keys := make([]string, len(failed))
		tokens := make([]int64, len(failed))
		for j, i := range failed {
			keys[j], tokens[j] = items[i].Key, rows[i].rec.Token
		}
		out = append(out, qstmt{stmt: stmt{sql: s.sql(sqlReleaseMany), args: []interface{}{keys, tokens, s.Scope}},
			read: drain})
	}
	return out
}

// drain reads and drops a statement's rows.
func drain(rows pgx.Rows) error {
	for rows.Next() {
	}
	return rows.Err()
}

// qstmt is a statement whose rows, if read is set, are read by read.
type qstmt struct {
	stmt
	read func(pgx.Rows) error
	tag  *pgconn.CommandTag // set, when not nil, to the command tag of a statement without read
}

// oneTrip runs stmts in one transaction: in one batch on the pool, an
// implicit transaction that commits at its end (one round trip), or, when
// the pool prefers the simple protocol, one statement at a time in an
// explicit transaction.
func (s *PostgresStore) oneTrip(ctx context.Context, stmts []qstmt) error {
	simple := s.pool.Config().ConnConfig.PreferSimpleProtocol
	if simple && len(stmts) == 1 {
		return runStmts(ctx, s.pool, true, stmts)
	}
	if simple {
		tx, err := s.pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer rollback(tx)
		if err := runOnTx(ctx, tx, stmts); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	b := &pgx.Batch{}
	for _, st := range stmts {
		b.Queue(st.sql, st.args...)
	}
	br := s.pool.SendBatch(ctx, b)
	for _, st := range stmts {
		if err := readResult(br, st); err != nil {
			br.Close()
			return err
		}
	}
	return br.Close()
}

// readResult reads st's result from br.
func readResult(br pgx.BatchResults, st qstmt) error {
	if st.read == nil {
		tag, err := br.Exec()
		if st.tag != nil && err == nil {
			*st.tag = tag
		}
		return err
	}
	rows, err := br.Query()
	if err != nil {
		return err
	}
	err = st.read(rows)
	rows.Close()
	if err == nil {
		err = rows.Err()
	}
	return err
}

// runOnTx runs stmts on tx: in one batch, or one at a time when the
// connection prefers the simple protocol.
func runOnTx(ctx context.Context, tx pgx.Tx, stmts []qstmt) error {
	return runStmts(ctx, tx, tx.Conn().Config().PreferSimpleProtocol, stmts)
}

// runStmts runs stmts on tx: in one batch, or one at a time when simple.
func runStmts(ctx context.Context, tx runner, simple bool, stmts []qstmt) error {
	if !simple {
		b := &pgx.Batch{}
		for _, st := range stmts {
			b.Queue(st.sql, st.args...)
		}
		br := tx.SendBatch(ctx, b)
		for _, st := range stmts {
			if err := readResult(br, st); err != nil {
				br.Close()
				return err
			}
		}
		return br.Close()
	}
	for _, st := range stmts {
		args := append([]interface{}{extended}, st.args...)
		if st.read == nil {
			tag, err := tx.Exec(ctx, st.sql, args...)
			if err != nil {
				return err
			}
			if st.tag != nil {
				*st.tag = tag
			}
			continue
		}
		rows, err := tx.Query(ctx, st.sql, args...)
		if err != nil {
			return err
		}
		err = st.read(rows)
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// localStmts are the statements that apply the clock offset and the
// timeouts of ctx's deadline, as qstmts.
func (s *PostgresStore) localStmts(ctx context.Context, now time.Time) []qstmt {
	var out []qstmt
	for _, st := range s.locals(ctx, now) {
		out = append(out, qstmt{stmt: st})
	}
	return out
}

// beginMany claims the keys of items with one idem_begin_many call in its
// own transaction (one round trip; see DoMany), and answers, per item in
// input order, the record, whether it was claimed and the position of the
// item's first occurrence (-1 when the key is not repeated in the batch).
// If the claims' commit fails or is cut off, the claims it made are
// released.
func (s *PostgresStore) beginMany(ctx context.Context, items []Item, now time.Time, lease, retention, wait time.Duration) ([]manyRow, error) {
	if err := s.fault("begin"); err != nil {
		return nil, err
	}
	cctx, cancel := s.callContext(ctx, wait)
	defer cancel()
	var rows []manyRow
	stmts := append(s.localStmts(cctx, now), s.beginManyStmt(items, lease, retention, wait, &rows))
	if err := s.oneTrip(cctx, stmts); err != nil {
		for i, r := range rows {
			if r.claimed {
				s.releaseQuietly(items[i].Key, r.rec.Token, now)
			}
		}
		return nil, s.mapError(err, fnBeginMany)
	}
	return rows, nil
}

// batchRun is the state of one batch while its handlers run.
type batchRun struct {
	items   []Item
	rows    []manyRow
	results []Result
	resps   []Response
	done    []int // executed without error: to complete
	failed  []int // the handler failed: to release
}

func newBatchRun(items []Item, rows []manyRow) *batchRun {
	b := &batchRun{items: items, rows: rows, results: make([]Result, len(items)), resps: make([]Response, len(items))}
	for i, r := range rows {
		b.results[i].DuplicateOf = r.dupOf
		if r.claimed || r.rec.State == duplicateState {
			continue
		}
		b.results[i].Response, b.results[i].Outcome, b.results[i].Err = answer(r.rec)
	}
	return b
}

// copyDuplicates gives every DUPLICATE item its first occurrence's result.
func (b *batchRun) copyDuplicates() {
	for i, r := range b.rows {
		if r.rec.State != duplicateState || r.dupOf < 0 || r.dupOf >= len(b.results) {
			continue
		}
		res := b.results[r.dupOf]
		res.DuplicateOf = r.dupOf
		b.results[i] = res
	}
}

// failAll gives err to every item that was executed without error.
func (b *batchRun) failAll(err error) {
	for _, i := range b.done {
		b.results[i].Err = err
	}
}

func unavailableAll(n int, err error) []Result {
	res := make([]Result, n)
	for i := range res {
		res[i] = Result{Outcome: Unavailable, Err: err, DuplicateOf: -1}
	}
	return res
}

// DoMany runs fn once for each item of a batch whose key it claims, and
// answers the others as Do would, each item on its own: it returns one
// Result per item, in input order.
//
// With a *PostgresStore, the keys are claimed with one idem_begin_many
// call (one round trip on the extended protocol) that commits the claims
// before any handler runs, in the server's lock order (the keys sorted),
// so that two overlapping batches never deadlock.  With WaitFor, items
// found in flight are waited for up to WaitFor in all (one deadline for
// the batch); an item still in flight then is InFlight with ErrInFlight,
// the others go on.  The handlers of the claimed items run one after
// another in input order, fn(ctx, i) for item i, its context carrying the
// item's claim (ClaimFromContext).  Then one round trip stores every
// response with idem_complete_many and releases (idem_release) the claim
// of every item whose handler failed: that item is Executed with the
// handler's error, and a retry of the batch runs it again, while the other
// items replay.  A key repeated in the batch is claimed once, for its
// first occurrence; later occurrences (DuplicateOf) get its result.
//
// If the claim fails, every item is Unavailable with ErrUnavailable and
// no handler runs.  If idem_complete_many is refused for good (a data
// error such as a body over idem.max_body_size), the responses are
// stored one by one as Do stores them, so that only the item at fault
// gets NotStoredResponse.  Any other failure to store them (a lost
// connection) is the error of every executed item, whose keys stay in
// flight until their leases end.  Heartbeat does not apply: Lease must
// cover the whole batch's handlers.
//
// With another store, DoMany calls Do for each item in turn (with
// ReleaseOnError), answering repeated keys as above.
func (g *Guard) DoMany(ctx context.Context, items []Item, fn func(ctx context.Context, i int) (Response, error)) []Result {
	s, ok := g.Store.(*PostgresStore)
	if !ok {
		return g.doManyEach(ctx, items, fn)
	}
	if len(items) == 0 {
		return []Result{}
	}
	now := g.now()
	wait := g.WaitFor
	if wait < 0 {
		wait = 0
	}
	rows, err := s.beginMany(ctx, items, now, g.Lease, g.Retention, wait)
	if err != nil {
		return unavailableAll(len(items), unavailable(err))
	}
	b := newBatchRun(items, rows)
	for i, r := range rows {
		if !r.claimed {
			continue
		}
		cctx := WithClaim(ctx, Claim{Key: items[i].Key, Token: r.rec.Token})
		resp, ferr := fn(cctx, i)
		b.results[i] = Result{Response: resp, Outcome: Executed, Err: ferr, DuplicateOf: -1}
		b.resps[i] = resp
		if ferr != nil {
			b.failed = append(b.failed, i)
		} else {
			b.done = append(b.done, i)
		}
	}
	if len(b.done)+len(b.failed) > 0 {
		g.finishMany(ctx, s, b, now)
	}
	b.copyDuplicates()
	return b.results
}

// finishMany stores the batch's responses and releases its failed claims
// in one round trip; a complete the server refuses for good falls back to
// one Complete per item.
func (g *Guard) finishMany(ctx context.Context, s *PostgresStore, b *batchRun, now time.Time) {
	err := s.fault("complete")
	if err == nil {
		cctx, cancel := s.callContext(ctx, 0)
		stmts := append(s.localStmts(cctx, now), s.finishStmts(b.items, b.rows, b.done, b.failed, b.resps, g.Retention)...)
		err = s.mapError(s.oneTrip(cctx, stmts), fnFinishMany)
		cancel()
	}
	if err == nil {
		return
	}
	if !notStorable(err) {
		b.failAll(err)
		for _, i := range b.failed {
			b.results[i].Err = fmt.Errorf("%w (release failed: %v)", b.results[i].Err, err)
		}
		return
	}
	// One item's response was refused: store each on its own, as Do does.
	for _, i := range b.done {
		key, fp := b.items[i].Key, b.items[i].Fingerprint
		cctx := WithClaim(ctx, Claim{Key: key, Token: b.rows[i].rec.Token})
		if cerr := s.Complete(cctx, key, fp, b.resps[i], now, g.Retention); cerr != nil {
			if notStorable(cerr) {
				cerr = g.storeNotStored(cctx, key, fp, now, cerr)
			}
			b.results[i].Err = cerr
		}
	}
	for _, i := range b.failed {
		if _, rerr := s.Release(ctx, b.items[i].Key, b.rows[i].rec.Token, now); rerr != nil {
			b.results[i].Err = fmt.Errorf("%w (release failed: %v)", b.results[i].Err, rerr)
		}
	}
}

// doManyEach is DoMany for a store without batches: Do per item.
func (g *Guard) doManyEach(ctx context.Context, items []Item, fn func(ctx context.Context, i int) (Response, error)) []Result {
	gg := *g
	gg.ReleaseOnError = true
	res := make([]Result, len(items))
	first := map[string]int{}
	for i, it := range items {
		if j, ok := first[it.Key]; ok {
			if items[j].Fingerprint != it.Fingerprint {
				res[i] = Result{Outcome: Conflicted, Err: ErrConflict, DuplicateOf: j}
			} else {
				res[i] = res[j]
				res[i].DuplicateOf = j
			}
			continue
		}
		first[it.Key] = i
		i := i
		resp, out, err := gg.Do(ctx, it.Key, it.Fingerprint, func(c context.Context) (Response, error) { return fn(c, i) })
		res[i] = Result{Response: resp, Outcome: out, Err: err, DuplicateOf: -1}
	}
	return res
}

// DoManyTx is DoMany in one transaction with the handlers' own writes, as
// DoTx is for one key: it claims every key with one idem_begin_many call
// in a transaction, runs fn(ctx, tx, i) for each claimed item in input
// order inside a savepoint of its own, stores the responses with
// idem_complete_many and commits.  A handler that fails rolls back to its
// savepoint and its claim is released in the transaction: its writes and
// its claim are gone, the item is Executed with the handler's error, and
// the others commit.  A key repeated in the batch is answered as in
// DoMany.
//
// The error returned is the batch's own: the claim, the complete or the
// COMMIT failed, and nothing of the batch was committed (unless the
// commit itself was cut off, when its result is unknown); every item then
// carries that error too (Unavailable when the claim failed).  With
// TxRetries, a batch that fails with 40001 or 40P01 runs again, as DoTx
// does, handlers included.  g.Store must be a *PostgresStore.  Lease,
// Heartbeat and ReleaseOnError do not apply; WaitFor does, for claims
// committed by others (a claim not yet committed is always waited for).
func (g *Guard) DoManyTx(ctx context.Context, items []Item, fn func(ctx context.Context, tx pgx.Tx, i int) (Response, error)) ([]Result, error) {
	s, ok := g.Store.(*PostgresStore)
	if !ok {
		err := fmt.Errorf("%w: DoManyTx needs a *PostgresStore", ErrUnavailable)
		return unavailableAll(len(items), err), err
	}
	if len(items) == 0 {
		return []Result{}, nil
	}
	for retry := 0; ; retry++ {
		res, err := g.doManyTx(ctx, s, items, fn)
		if err == nil || retry >= g.TxRetries || !retryableTx(err) || !txBackoff(ctx, retry) {
			return res, err
		}
	}
}

// doManyTx is one attempt of DoManyTx.
func (g *Guard) doManyTx(ctx context.Context, s *PostgresStore, items []Item, fn func(context.Context, pgx.Tx, int) (Response, error)) ([]Result, error) {
	now := g.now()
	fail := func(err error) ([]Result, error) {
		err = unavailable(err)
		return unavailableAll(len(items), err), err
	}
	if err := s.fault("begin"); err != nil {
		return fail(err)
	}
	wait := g.WaitFor
	if wait < 0 {
		wait = 0
	}
	// One round trip: BEGIN, the settings bounding the claims, the claims
	// and the transaction's own timeouts put back for the handlers.
	var rows []manyRow
	tx, err := func() (*connTx, error) {
		cctx, cancel := s.callContext(ctx, wait)
		defer cancel()
		tx, err := s.beginTx(cctx, s.boundedStmts(cctx, now, s.beginManyStmt(items, g.Lease, g.Retention, wait, &rows)))
		return tx, s.mapError(err, fnBeginMany)
	}()
	if err != nil {
		return fail(err)
	}
	defer tx.end()
	b := newBatchRun(items, rows)
	for i, r := range rows {
		if !r.claimed {
			continue
		}
		sp, err := tx.Begin(ctx)
		if err != nil {
			return g.batchFailed(b, err)
		}
		resp, ferr := fn(WithClaim(ctx, Claim{Key: items[i].Key, Token: r.rec.Token}), sp, i)
		b.results[i] = Result{Response: resp, Outcome: Executed, Err: ferr, DuplicateOf: -1}
		b.resps[i] = resp
		if ferr != nil {
			b.failed = append(b.failed, i)
			err = sp.Rollback(ctx)
		} else {
			b.done = append(b.done, i)
			err = sp.Commit(ctx)
		}
		if err != nil {
			return g.batchFailed(b, err)
		}
	}
	if len(b.done)+len(b.failed) > 0 {
		if err := s.fault("complete"); err != nil {
			return g.batchFailed(b, err)
		}
		cctx, cancel := s.callContext(ctx, 0)
		defer cancel()
		// One round trip: the completes, the releases and the COMMIT.
		if err := tx.commitWith(cctx, s.finishStmts(items, rows, b.done, b.failed, b.resps, g.Retention)); err != nil {
			return g.batchFailed(b, s.mapError(err, fnFinishMany))
		}
	} else {
		// Nothing was claimed; the answers stand whatever the commit says.
		_ = tx.commitWith(ctx, nil)
	}
	b.copyDuplicates()
	return b.results, nil
}

// batchFailed ends a DoManyTx attempt whose transaction failed after the
// claim: every executed item carries err, and nothing was stored.
func (g *Guard) batchFailed(b *batchRun, err error) ([]Result, error) {
	for _, i := range append(append([]int{}, b.done...), b.failed...) {
		b.results[i].Err = err
	}
	for i, r := range b.rows {
		if r.claimed && b.results[i].Outcome == "" {
			// Its handler did not run; its claim was rolled back.
			b.results[i] = Result{Outcome: Unavailable, Err: unavailable(err), DuplicateOf: -1}
		}
	}
	b.copyDuplicates()
	return b.results, err
}
