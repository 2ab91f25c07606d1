package idempotency

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v4"
)

// Message is one message a broker delivered: its id (the producer's
// message id, the same on every redelivery) and, optionally, a
// fingerprint of its content.  An empty Fingerprint is "message": the id
// alone tells two messages apart.
type Message struct {
	ID          string
	Fingerprint string
	Body        []byte
}

// Delivery is what Inbox.Consume did with one message of a batch.
//
// Ack tells the consumer to acknowledge the message to the broker (after
// Consume returned): its effects are committed, now (Executed) or by an
// earlier delivery (Replayed, Expired).  A message not to be acked (its
// handler failed, it is in flight elsewhere, its id came with another
// fingerprint, or the batch failed) must be left to come back: nack it
// with requeue, or leave it pending.
type Delivery struct {
	Outcome Outcome
	Ack     bool
	Err     error
}

// Inbox deduplicates the messages of one queue in PostgreSQL with the
// business writes of their handlers: each batch of delivered messages is
// one transaction that claims every message id (idem_begin_many, scope =
// Queue), runs the handler of each new message inside a savepoint of its
// own, stores the outcomes (idem_complete_many) and commits, before the
// consumer acks anything.  A redelivered message whose transaction
// committed is acked without running its handler again; one whose
// transaction did not commit (the consumer died before the commit) left
// nothing behind and runs again.  So the handler's writes happen once per
// message id, however often the broker delivers it and wherever the
// consumer dies.
//
// Store is the database (its Scope is replaced by Queue; its ClientClock,
// Schema, Timeout and Remember apply).  Retention is how long a message
// id is remembered after its handler committed (0: the server's
// idem.default_retention): longer than the broker may redeliver it.
// WaitFor and TxRetries are Guard's.
type Inbox struct {
	Store     *PostgresStore
	Queue     string
	Retention time.Duration
	WaitFor   time.Duration
	TxRetries int
}

// MessageFingerprint is the fingerprint of a Message that has none.
const MessageFingerprint = "message"

// Consume runs handle for every message of msgs that the queue has not
// seen done, in one transaction (see Inbox), and answers one Delivery per
// message in input order.  handle gets the message's savepoint as tx:
// its business writes go there.  A handle error rolls that message back
// (its writes and its claim): it is not acked and the others commit.
// The error returned is the batch's own (claim, complete or COMMIT
// failed): then no message is acked.  A message delivered twice in one
// batch runs once, and both deliveries get its answer.
func (in *Inbox) Consume(ctx context.Context, msgs []Message, handle func(ctx context.Context, tx pgx.Tx, msg Message) error) ([]Delivery, error) {
	if in.Store == nil {
		return nil, errors.New("idempotency: Inbox has no Store")
	}
	store := *in.Store
	store.Scope = in.Queue
	g := &Guard{Store: &store, Retention: in.Retention, WaitFor: in.WaitFor, TxRetries: in.TxRetries}
	items := make([]Item, len(msgs))
	for i, m := range msgs {
		fp := m.Fingerprint
		if fp == "" {
			fp = MessageFingerprint
		}
		items[i] = Item{Key: m.ID, Fingerprint: fp}
	}
	res, err := g.DoManyTx(ctx, items, func(ctx context.Context, tx pgx.Tx, i int) (Response, error) {
		if herr := handle(ctx, tx, msgs[i]); herr != nil {
			return Response{}, herr
		}
		return Response{Status: 200}, nil
	})
	out := make([]Delivery, len(res))
	for i, r := range res {
		ack := err == nil && r.Err == nil && (r.Outcome == Executed || r.Outcome == Replayed)
		if err == nil && r.Outcome == Expired {
			ack = true
		}
		out[i] = Delivery{Outcome: r.Outcome, Ack: ack, Err: r.Err}
	}
	return out, err
}
