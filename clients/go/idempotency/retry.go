package idempotency

import (
	"context"
	"errors"
	"math/rand"
	"sync"
	"time"

	"github.com/jackc/pgconn"
)

// The backoff between two attempts of DoTx's transaction (Guard.TxRetries):
// a random time from 0 to txRetryBase doubled for each retry, at most
// txRetryCap.
const (
	txRetryBase = 10 * time.Millisecond
	txRetryCap  = time.Second
)

var (
	jitterMu sync.Mutex
	// jitter is seeded per process, so that processes that failed together
	// do not retry together.
	jitter = rand.New(rand.NewSource(time.Now().UnixNano()))
)

// retryableTx tells whether err asks for the transaction to run again: a
// serialization failure (40001) or a deadlock (40P01) that the server
// answered, after which it has rolled the transaction back.
func retryableTx(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && (pg.Code == "40001" || pg.Code == "40P01")
}

// txBackoff sleeps before retry number retry+1 and tells whether to make
// it: false when ctx is done, or its deadline would pass during the sleep.
func txBackoff(ctx context.Context, retry int) bool {
	limit := txRetryCap
	if retry < 20 && txRetryBase<<retry < txRetryCap {
		limit = txRetryBase << retry
	}
	jitterMu.Lock()
	d := time.Duration(jitter.Int63n(int64(limit) + 1))
	jitterMu.Unlock()
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= d {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
