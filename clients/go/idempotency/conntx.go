package idempotency

// A transaction whose BEGIN travels in one batch with its first
// statements, and whose COMMIT travels with its last: DoTx, DoManyTx
// (Inbox) and StepTx open one claim-to-commit transaction in two round
// trips besides the handler's own statements.  pgx v4's Conn.Begin sends
// its BEGIN alone, and its pgx.Tx cannot be made over a transaction begun
// otherwise, so connTx is a pgx.Tx of this package's own, over a
// connection acquired from the pool.

import (
	"context"
	"strconv"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// sqlSaveTimeoutsLocal and sqlRestoreTimeoutsLocal keep the transaction's
// own lock_timeout and statement_timeout on the server, in settings of the
// transaction (idem_go.*; "idem." is the extension's reserved prefix), so
// that a claim's bound is saved before it and put back after it in the
// claim's own batch, without the client reading the saved values first.
const (
	sqlSaveTimeoutsLocal = "SELECT pg_catalog.set_config('idem_go.lock_timeout', pg_catalog.current_setting('lock_timeout'), true)," +
		" pg_catalog.set_config('idem_go.statement_timeout', pg_catalog.current_setting('statement_timeout'), true)"
	sqlRestoreTimeoutsLocal = "SELECT pg_catalog.set_config('lock_timeout', pg_catalog.current_setting('idem_go.lock_timeout'), true)," +
		" pg_catalog.set_config('statement_timeout', pg_catalog.current_setting('idem_go.statement_timeout'), true)"
)

// boundedStmts are the statements that bound a claim in a transaction that
// goes on after it (a handler's statements follow): the clock offset, the
// transaction's timeouts saved and bounded by ctx's deadline before
// claim, and put back after it.
func (s *PostgresStore) boundedStmts(ctx context.Context, now time.Time, claim ...qstmt) []qstmt {
	var out []qstmt
	if s.ClientClock {
		out = append(out, qstmt{stmt: stmt{sql: sqlClock, args: []interface{}{now}}})
	}
	timeout := serverTimeout(ctx)
	if timeout == "" {
		return append(out, claim...)
	}
	out = append(out, qstmt{stmt: stmt{sql: sqlSaveTimeoutsLocal}},
		qstmt{stmt: stmt{sql: sqlTimeouts, args: []interface{}{timeout}}})
	out = append(out, claim...)
	return append(out, qstmt{stmt: stmt{sql: sqlRestoreTimeoutsLocal}})
}

// connTx is a transaction on a connection of the pool: beginTx sends its
// BEGIN with its first statements, commitWith its COMMIT with its last.
// It is a pgx.Tx for the handlers: Begin makes a savepoint as pgx's does,
// Commit and Rollback end it, the rest runs on the connection.
type connTx struct {
	pc     *pgxpool.Conn
	conn   *pgx.Conn
	closed bool
	spNum  int64
	lo     pgx.Tx // a pgx.Tx over the same transaction, for LargeObjects
}

// beginTx acquires a connection and runs BEGIN and stmts on it in one
// batch (one statement at a time when the connection prefers the simple
// protocol).  On an error the transaction is rolled back and the
// connection given back.
func (s *PostgresStore) beginTx(ctx context.Context, stmts []qstmt) (*connTx, error) {
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	t := &connTx{pc: pc, conn: pc.Conn()}
	if err := runOnTx(ctx, t, append([]qstmt{{stmt: stmt{sql: "BEGIN"}}}, stmts...)); err != nil {
		t.end()
		return nil, err
	}
	return t, nil
}

// commitWith runs stmts and COMMIT in one batch (one at a time when the
// connection prefers the simple protocol).  A COMMIT that the server
// answers with ROLLBACK (the transaction had failed) is
// pgx.ErrTxCommitRollback, as pgx's Commit reports it.
func (t *connTx) commitWith(ctx context.Context, stmts []qstmt) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	var tag pgconn.CommandTag
	commit := qstmt{stmt: stmt{sql: "COMMIT"}, tag: &tag}
	err := runOnTx(ctx, t, append(append([]qstmt{}, stmts...), commit))
	if tag != nil {
		t.closed = true
		if string(tag) == "ROLLBACK" {
			return pgx.ErrTxCommitRollback
		}
	}
	return err
}

// end rolls the transaction back unless it ended (one round trip, only
// when it is still open on the server) and gives the connection back; a
// connection left in a transaction is closed by the pool.
func (t *connTx) end() {
	if t.pc == nil {
		return
	}
	if t.conn.PgConn().TxStatus() != 'I' && !t.conn.IsClosed() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _ = t.conn.Exec(ctx, "ROLLBACK")
		cancel()
	}
	t.closed = true
	t.pc.Release()
	t.pc = nil
}

// Begin makes a savepoint, as pgx's Tx.Begin does.
func (t *connTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	t.spNum++
	if _, err := t.conn.Exec(ctx, "savepoint sp_"+strconv.FormatInt(t.spNum, 10)); err != nil {
		return nil, err
	}
	return &savepoint{tx: t, num: t.spNum}, nil
}

func (t *connTx) BeginFunc(ctx context.Context, f func(pgx.Tx) error) error {
	return beginFunc(ctx, t, f)
}

// beginFunc is pgx's BeginFunc on tx.
func beginFunc(ctx context.Context, tx pgx.Tx, f func(pgx.Tx) error) error {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = sp.Rollback(ctx) }()
	if err := f(sp); err != nil {
		return err
	}
	return sp.Commit(ctx)
}

// Commit commits the transaction (the handler's own commit: then the
// guard's complete fails with pgx.ErrTxClosed, as with pgx's Tx).
func (t *connTx) Commit(ctx context.Context) error { return t.commitWith(ctx, nil) }

func (t *connTx) Rollback(ctx context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	_, err := t.conn.Exec(ctx, "rollback")
	t.closed = true
	return err
}

func (t *connTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if t.closed {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, cols, src)
}

func (t *connTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed {
		return closedBatch{}
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects needs a pgx.Tx of pgx's own: the first call opens one on
// the connection (its BEGIN, inside this transaction, only warns) and
// never ends it; this transaction's Commit and Rollback end both.
func (t *connTx) LargeObjects() pgx.LargeObjects {
	if t.lo == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if tx, err := t.conn.Begin(ctx); err == nil {
			t.lo = tx
		}
	}
	if t.lo == nil {
		return pgx.LargeObjects{}
	}
	return t.lo.LargeObjects()
}

func (t *connTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Prepare(ctx, name, sql)
}

func (t *connTx) Exec(ctx context.Context, sql string, args ...interface{}) (pgconn.CommandTag, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *connTx) Query(ctx context.Context, sql string, args ...interface{}) (pgx.Rows, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *connTx) QueryRow(ctx context.Context, sql string, args ...interface{}) pgx.Row {
	if t.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *connTx) QueryFunc(ctx context.Context, sql string, args []interface{}, scans []interface{}, f func(pgx.QueryFuncRow) error) (pgconn.CommandTag, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.QueryFunc(ctx, sql, args, scans, f)
}

func (t *connTx) Conn() *pgx.Conn { return t.conn }

// closedBatch is the batch of a closed transaction.
type closedBatch struct{}

func (closedBatch) Exec() (pgconn.CommandTag, error) { return nil, pgx.ErrTxClosed }
func (closedBatch) Query() (pgx.Rows, error)         { return nil, pgx.ErrTxClosed }
func (closedBatch) QueryRow() pgx.Row                { return errRow{pgx.ErrTxClosed} }
func (closedBatch) QueryFunc([]interface{}, func(pgx.QueryFuncRow) error) (pgconn.CommandTag, error) {
	return nil, pgx.ErrTxClosed
}
func (closedBatch) Close() error { return pgx.ErrTxClosed }

// savepoint is a pseudo nested transaction of a connTx, as pgx's.
type savepoint struct {
	tx     *connTx
	num    int64
	closed bool
}

func (sp *savepoint) Begin(ctx context.Context) (pgx.Tx, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.tx.Begin(ctx)
}

func (sp *savepoint) BeginFunc(ctx context.Context, f func(pgx.Tx) error) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	return beginFunc(ctx, sp.tx, f)
}

func (sp *savepoint) Commit(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.Exec(ctx, "release savepoint sp_"+strconv.FormatInt(sp.num, 10))
	sp.closed = true
	return err
}

func (sp *savepoint) Rollback(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.Exec(ctx, "rollback to savepoint sp_"+strconv.FormatInt(sp.num, 10))
	sp.closed = true
	return err
}

func (sp *savepoint) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if sp.closed {
		return 0, pgx.ErrTxClosed
	}
	return sp.tx.CopyFrom(ctx, table, cols, src)
}

func (sp *savepoint) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if sp.closed {
		return closedBatch{}
	}
	return sp.tx.SendBatch(ctx, b)
}

func (sp *savepoint) LargeObjects() pgx.LargeObjects { return sp.tx.LargeObjects() }

func (sp *savepoint) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.tx.Prepare(ctx, name, sql)
}

func (sp *savepoint) Exec(ctx context.Context, sql string, args ...interface{}) (pgconn.CommandTag, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.tx.Exec(ctx, sql, args...)
}

func (sp *savepoint) Query(ctx context.Context, sql string, args ...interface{}) (pgx.Rows, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.tx.Query(ctx, sql, args...)
}

func (sp *savepoint) QueryRow(ctx context.Context, sql string, args ...interface{}) pgx.Row {
	if sp.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return sp.tx.QueryRow(ctx, sql, args...)
}

func (sp *savepoint) QueryFunc(ctx context.Context, sql string, args []interface{}, scans []interface{}, f func(pgx.QueryFuncRow) error) (pgconn.CommandTag, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.tx.QueryFunc(ctx, sql, args, scans, f)
}

func (sp *savepoint) Conn() *pgx.Conn { return sp.tx.Conn() }
