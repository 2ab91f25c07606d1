package idempotency

// Batches: DoMany, DoManyTx and Inbox.Consume.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v4"
)

// echoHandler answers item i's key as the body and counts its runs.
func echoHandler(items []Item, runs []int32) func(context.Context, int) (Response, error) {
	return func(ctx context.Context, i int) (Response, error) {
		atomic.AddInt32(&runs[i], 1)
		if c, ok := ClaimFromContext(ctx); !ok || c.Key != items[i].Key || c.Token == 0 {
			return Response{}, fmt.Errorf("item %d: claim %+v in the context", i, c)
		}
		return Response{Status: 201, Body: []byte("r:" + items[i].Key)}, nil
	}
}

func TestDoManyOrderAndOutcomes(t *testing.T) {
	store := NewPostgresStore(testPool)
	store.Scope = newScope(t)
	g := &Guard{Store: store}
	// b is done before the batch, c is used with another fingerprint.
	if _, out, err := g.Do(bg, "b", "fp", func(context.Context) (Response, error) {
		return Response{Status: 202, Body: []byte("earlier")}, nil
	}); out != Executed || err != nil {
		t.Fatalf("b: %s %v", out, err)
	}
	if _, out, err := g.Do(bg, "c", "other", func(context.Context) (Response, error) {
		return Response{Status: 200}, nil
	}); out != Executed || err != nil {
		t.Fatalf("c: %s %v", out, err)
	}
	items := []Item{{"e", "fp"}, {"b", "fp"}, {"c", "fp"}, {"a", "fp"}, {"d", "fp"}}
	runs := make([]int32, len(items))
	var order []int
	h := echoHandler(items, runs)
	res := g.DoMany(bg, items, func(ctx context.Context, i int) (Response, error) {
		order = append(order, i)
		return h(ctx, i)
	})
	want := []Outcome{Executed, Replayed, Conflicted, Executed, Executed}
	for i, r := range res {
		if r.Outcome != want[i] || r.DuplicateOf != -1 {
			t.Fatalf("item %d: %+v, want %s", i, r, want[i])
		}
	}
	if fmt.Sprint(order) != "[0 3 4]" {
		t.Fatalf("handlers ran in order %v, want the input order [0 3 4]", order)
	}
	if string(res[1].Response.Body) != "earlier" || res[1].Response.Status != 202 || !errors.Is(res[2].Err, ErrConflict) {
		t.Fatalf("replay %+v, conflict %v", res[1], res[2].Err)
	}
	// A retry of the batch replays every executed item, in input order.
	again := g.DoMany(bg, items, echoHandler(items, runs))
	for i, r := range again {
		if i == 2 {
			continue
		}
		if r.Outcome != Replayed || r.Err != nil {
			t.Fatalf("retry item %d: %+v", i, r)
		}
		if i != 1 && string(r.Response.Body) != "r:"+items[i].Key {
			t.Fatalf("retry item %d replayed %q", i, r.Response.Body)
		}
	}
	for i, n := range runs {
		if (i == 0 || i == 3 || i == 4) != (n == 1) || n > 1 {
			t.Fatalf("handler runs %v", runs)
		}
	}
	if st := lookup(t, store.Scope, "d"); st.state != "DONE" || *st.status != 201 {
		t.Fatalf("d: %+v", st)
	}
}

func TestDoManyDuplicateKey(t *testing.T) {
	for _, mem := range []bool{false, true} {
		t.Run(map[bool]string{false: "postgres", true: "memory"}[mem], func(t *testing.T) {
			var store Store
			if mem {
				store = NewMemoryStore()
			} else {
				ps := NewPostgresStore(testPool)
				ps.Scope = newScope(t)
				store = ps
			}
			g := &Guard{Store: store}
			items := []Item{{"x", "fp"}, {"y", "fp"}, {"x", "fp"}, {"x", "fp2"}}
			runs := make([]int32, len(items))
			res := g.DoMany(bg, items, echoHandler(items, runs))
			if res[0].Outcome != Executed || res[1].Outcome != Executed || res[0].DuplicateOf != -1 {
				t.Fatalf("first occurrences: %+v %+v", res[0], res[1])
			}
			if r := res[2]; r.Outcome != Executed || r.DuplicateOf != 0 || string(r.Response.Body) != "r:x" || r.Err != nil {
				t.Fatalf("the repeat: %+v, want the first occurrence's result", r)
			}
			if r := res[3]; r.Outcome != Conflicted || r.DuplicateOf != 0 || !errors.Is(r.Err, ErrConflict) {
				t.Fatalf("the repeat with another fingerprint: %+v", r)
			}
			if runs[0] != 1 || runs[2] != 0 || runs[3] != 0 {
				t.Fatalf("handler runs %v: the key ran more than once", runs)
			}
		})
	}
}

func TestDoManyHandlerError(t *testing.T) {
	store := NewPostgresStore(testPool)
	store.Scope = newScope(t)
	g := &Guard{Store: store}
	items := []Item{{"k1", "fp"}, {"k2", "fp"}, {"k3", "fp"}}
	boom := errors.New("boom")
	var runs [3]int32
	fn := func(fail bool) func(context.Context, int) (Response, error) {
		return func(ctx context.Context, i int) (Response, error) {
			atomic.AddInt32(&runs[i], 1)
			if fail && i == 1 {
				return Response{}, boom
			}
			return Response{Status: 200, Body: []byte(items[i].Key)}, nil
		}
	}
	res := g.DoMany(bg, items, fn(true))
	if res[0].Err != nil || res[2].Err != nil || res[1].Outcome != Executed || !errors.Is(res[1].Err, boom) {
		t.Fatalf("results %+v", res)
	}
	// Only the failed item was released; the others are stored.
	if st := lookup(t, store.Scope, "k2"); st.found {
		t.Fatalf("k2 still held: %+v", st)
	}
	for _, k := range []string{"k1", "k3"} {
		if st := lookup(t, store.Scope, k); st.state != "DONE" {
			t.Fatalf("%s: %+v", k, st)
		}
	}
	// The retry runs the failed item alone.
	res = g.DoMany(bg, items, fn(false))
	if res[0].Outcome != Replayed || res[1].Outcome != Executed || res[2].Outcome != Replayed || res[1].Err != nil {
		t.Fatalf("retry %+v", res)
	}
	if runs != [3]int32{1, 2, 1} {
		t.Fatalf("runs %v", runs)
	}
}

func TestDoManyWaitsForSomeItems(t *testing.T) {
	store := NewPostgresStore(testPool)
	store.Scope = newScope(t)
	holder := &Guard{Store: store}
	// "slow" is held by a Do that completes after 300 ms; "stuck" by a
	// claim nobody completes.
	started := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		holder.Do(bg, "slow", "fp", func(context.Context) (Response, error) {
			close(started)
			time.Sleep(300 * time.Millisecond)
			return Response{Status: 200, Body: []byte("slow done")}, nil
		})
	}()
	<-started
	if _, claimed, err := store.Begin(bg, "stuck", "fp", time.Now(), time.Minute, 0); !claimed || err != nil {
		t.Fatalf("stuck: %v %v", claimed, err)
	}
	g := &Guard{Store: store, WaitFor: 1500 * time.Millisecond}
	items := []Item{{"stuck", "fp"}, {"new", "fp"}, {"slow", "fp"}}
	runs := make([]int32, len(items))
	t0 := time.Now()
	res := g.DoMany(bg, items, echoHandler(items, runs))
	took := time.Since(t0)
	<-done
	if r := res[0]; r.Outcome != InFlight || !errors.Is(r.Err, ErrInFlight) {
		t.Fatalf("stuck: %+v", r)
	}
	if r := res[1]; r.Outcome != Executed || r.Err != nil {
		t.Fatalf("new: %+v", r)
	}
	if r := res[2]; r.Outcome != Replayed || string(r.Response.Body) != "slow done" {
		t.Fatalf("slow: %+v, want the holder's response after the wait", r)
	}
	if took < time.Second || runs[0]+runs[2] != 0 {
		t.Fatalf("took %v (WaitFor 1.5 s for the stuck item), runs %v", took, runs)
	}
	// Without WaitFor, both held items answer at once.
	g.WaitFor = 0
	if _, claimed, err := store.Begin(bg, "held", "fp", time.Now(), time.Minute, 0); !claimed || err != nil {
		t.Fatalf("held: %v %v", claimed, err)
	}
	res = g.DoMany(bg, []Item{{"held", "fp"}, {"stuck", "fp"}}, echoHandler(items, runs))
	if res[0].Outcome != InFlight || res[1].Outcome != InFlight {
		t.Fatalf("no wait: %+v", res)
	}
}

func TestDoManyRoundTrips(t *testing.T) {
	pool, writes := countedPool(t, false)
	store := NewPostgresStore(pool)
	store.Scope = newScope(t)
	g := &Guard{Store: store}
	items := make([]Item, 20)
	for i := range items {
		items[i] = Item{Key: fmt.Sprintf("rt-%02d", i), Fingerprint: "fp"}
	}
	runs := make([]int32, len(items))
	ctx, cancel := context.WithTimeout(bg, time.Hour)
	defer cancel()
	// The connection prepares the statements on first use, with and
	// without a deadline.
	g.DoMany(ctx, []Item{{"warm-0", "fp"}}, func(context.Context, int) (Response, error) { return Response{}, nil })
	warm := g.DoMany(bg, []Item{{"warm", "fp"}, {"warm-2", "fp"}}, func(context.Context, int) (Response, error) {
		return Response{Status: 200}, nil
	})
	if warm[0].Err != nil {
		t.Fatal(warm[0].Err)
	}
	g.DoMany(bg, []Item{{"warm-3", "fp"}}, func(context.Context, int) (Response, error) { return Response{}, errors.New("x") })
	writes.Store(0)
	res := g.DoMany(bg, items, echoHandler(items, runs))
	if n := writes.Load(); n != 2 {
		t.Fatalf("20 new items: %d round trips, want 2 (claim, complete)", n)
	}
	for i, r := range res {
		if r.Outcome != Executed || r.Err != nil {
			t.Fatalf("item %d: %+v", i, r)
		}
	}
	writes.Store(0)
	res = g.DoMany(bg, items, echoHandler(items, runs))
	if n := writes.Load(); n != 1 || res[19].Outcome != Replayed {
		t.Fatalf("replay: %d round trips, want 1; %+v", n, res[19])
	}
	// A handler error is released in the complete's round trip.
	items[3].Key = "rt-fails"
	writes.Store(0)
	res = g.DoMany(bg, items, func(ctx context.Context, i int) (Response, error) {
		return Response{}, errors.New("fails")
	})
	if n := writes.Load(); n != 2 || res[3].Outcome != Executed || res[3].Err == nil {
		t.Fatalf("a failed item: %d round trips, want 2; %+v", n, res[3])
	}
	// Under a deadline, the bound goes in the same batches.
	items[3].Key = "rt-deadline"
	writes.Store(0)
	res = g.DoMany(ctx, items, echoHandler(items, runs))
	if n := writes.Load(); n != 2 || res[3].Outcome != Executed {
		t.Fatalf("with a deadline: %d round trips, want 2; %+v", n, res[3])
	}
}

func TestDoManyBodyTooLarge(t *testing.T) {
	store := NewPostgresStore(testPool)
	store.Scope = newScope(t)
	var logged atomic.Int32
	g := &Guard{Store: store, Logf: func(string, ...interface{}) { logged.Add(1) }}
	var max int
	if err := testPool.QueryRow(bg, "SELECT pg_catalog.pg_size_bytes(pg_catalog.current_setting('idem.max_body_size'))::integer").Scan(&max); err != nil {
		t.Skip("no idem.max_body_size:", err)
	}
	items := []Item{{"small", "fp"}, {"huge", "fp"}}
	res := g.DoMany(bg, items, func(ctx context.Context, i int) (Response, error) {
		if i == 1 {
			return Response{Status: 200, Body: make([]byte, max+1)}, nil
		}
		return Response{Status: 200, Body: []byte("ok")}, nil
	})
	// The server stores NotStoredResponse in place of the body it
	// refuses, for that item alone (idem_complete's WARNING).
	if res[0].Err != nil || res[1].Err != nil || res[1].Outcome != Executed {
		t.Fatalf("results: %s %v, %s %v", res[0].Outcome, res[0].Err, res[1].Outcome, res[1].Err)
	}
	if st := lookup(t, store.Scope, "small"); st.state != "DONE" {
		t.Fatalf("small: %+v", st)
	}
	if st := lookup(t, store.Scope, "huge"); st.state != "DONE" || *st.status != NotStoredStatus {
		t.Fatalf("huge: %+v", st)
	}
}

func TestDoManyTx(t *testing.T) {
	table := "go_many_" + strings.ReplaceAll(fmt.Sprint(time.Now().UnixNano()), "-", "")
	if _, err := testPool.Exec(bg, "CREATE TABLE "+table+" (key text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testPool.Exec(context.Background(), "DROP TABLE "+table) })
	store := NewPostgresStore(testPool)
	store.Scope = newScope(t)
	g := &Guard{Store: store}
	items := []Item{{"t1", "fp"}, {"t2", "fp"}, {"t1", "fp"}, {"t3", "fp"}}
	var runs [4]int32
	fn := func(failT2 bool) func(context.Context, pgx.Tx, int) (Response, error) {
		return func(ctx context.Context, tx pgx.Tx, i int) (Response, error) {
			atomic.AddInt32(&runs[i], 1)
			if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", items[i].Key); err != nil {
				return Response{}, err
			}
			if failT2 && i == 1 {
				return Response{}, errors.New("t2 fails after its write")
			}
			return Response{Status: 201, Body: []byte(items[i].Key)}, nil
		}
	}
	res, err := g.DoManyTx(bg, items, fn(true))
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Outcome != Executed || res[0].Err != nil || res[1].Err == nil || res[3].Err != nil {
		t.Fatalf("results %+v", res)
	}
	if r := res[2]; r.DuplicateOf != 0 || string(r.Response.Body) != "t1" {
		t.Fatalf("repeat: %+v", r)
	}
	var keys string
	if err := testPool.QueryRow(bg, "SELECT pg_catalog.string_agg(key, ',' ORDER BY key) FROM "+table).Scan(&keys); err != nil {
		t.Fatal(err)
	}
	if keys != "t1,t3" {
		t.Fatalf("committed writes %q, want t1,t3 (t2's rolled back with its savepoint)", keys)
	}
	if st := lookup(t, store.Scope, "t2"); st.found {
		t.Fatalf("t2's claim committed: %+v", st)
	}
	res, err = g.DoManyTx(bg, items, fn(false))
	if err != nil || res[0].Outcome != Replayed || res[1].Outcome != Executed || res[3].Outcome != Replayed {
		t.Fatalf("retry: %v %+v", err, res)
	}
	if runs != [4]int32{1, 2, 0, 1} {
		t.Fatalf("runs %v", runs)
	}
	// A batch that fails as a whole commits nothing.
	store.Fault = func(op string) error {
		if op == "complete" {
			return errors.New("lost")
		}
		return nil
	}
	res, err = g.DoManyTx(bg, []Item{{"t4", "fp"}, {"t1", "fp"}}, func(ctx context.Context, tx pgx.Tx, i int) (Response, error) {
		_, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ('t4')")
		return Response{Status: 200}, err
	})
	if err == nil || res[0].Err == nil || res[1].Outcome != Replayed {
		t.Fatalf("failed batch: %v %+v", err, res)
	}
	if st := lookup(t, store.Scope, "t4"); st.found {
		t.Fatalf("t4 committed: %+v", st)
	}
}

func TestInboxConsume(t *testing.T) {
	table := "go_inbox_" + fmt.Sprint(time.Now().UnixNano())
	if _, err := testPool.Exec(bg, "CREATE TABLE "+table+" (msg_id text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = testPool.Exec(context.Background(), "DROP TABLE "+table) })
	in := &Inbox{Store: NewPostgresStore(testPool), Queue: newScope(t)}
	handle := func(failing string) func(context.Context, pgx.Tx, Message) error {
		return func(ctx context.Context, tx pgx.Tx, m Message) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1)", m.ID); err != nil {
				return err
			}
			if m.ID == failing {
				return errors.New("handler fails")
			}
			return nil
		}
	}
	msgs := []Message{{ID: "m1"}, {ID: "m2"}, {ID: "m3"}, {ID: "m1"}}
	d, err := in.Consume(bg, msgs, handle("m2"))
	if err != nil {
		t.Fatal(err)
	}
	acks := fmt.Sprint(d[0].Ack, d[1].Ack, d[2].Ack, d[3].Ack)
	if acks != "true false true true" || d[1].Err == nil {
		t.Fatalf("acks %s, %+v", acks, d)
	}
	// The broker redelivers m2 (not acked) and m3 (its ack was lost).
	d, err = in.Consume(bg, []Message{{ID: "m3"}, {ID: "m2"}}, handle(""))
	if err != nil || !d[0].Ack || d[0].Outcome != Replayed || !d[1].Ack || d[1].Outcome != Executed {
		t.Fatalf("redelivery: %v %+v", err, d)
	}
	var n, distinct int
	if err := testPool.QueryRow(bg, "SELECT count(*), count(DISTINCT msg_id) FROM "+table).Scan(&n, &distinct); err != nil {
		t.Fatal(err)
	}
	if n != 3 || distinct != 3 {
		t.Fatalf("effects %d (%d distinct), want 3", n, distinct)
	}
	// Another queue is another scope: the same ids are new there.
	other := &Inbox{Store: in.Store, Queue: in.Queue + "-other"}
	d, err = other.Consume(bg, []Message{{ID: "m1"}}, func(context.Context, pgx.Tx, Message) error { return nil })
	if err != nil || d[0].Outcome != Executed {
		t.Fatalf("other queue: %v %+v", err, d)
	}
}

// A pool that prefers the simple protocol runs the batch's statements one
// at a time in explicit transactions, with the same answers.
func TestDoManySimpleProtocol(t *testing.T) {
	pool, _ := countedPool(t, true)
	store := NewPostgresStore(pool)
	store.Scope = newScope(t)
	g := &Guard{Store: store}
	items := []Item{{"s1", "fp"}, {"s2", "fp"}, {"s1", "fp"}, {`s"3\{,}`, "fp"}}
	runs := make([]int32, len(items))
	ctx, cancel := context.WithTimeout(bg, time.Hour)
	defer cancel()
	res := g.DoMany(ctx, items, func(ctx context.Context, i int) (Response, error) {
		atomic.AddInt32(&runs[i], 1)
		if i == 1 {
			return Response{}, errors.New("s2 fails")
		}
		return Response{Status: 201, Body: []byte{0, 'x', byte(i)}}, nil
	})
	if res[0].Outcome != Executed || res[0].Err != nil || res[1].Err == nil || res[2].DuplicateOf != 0 || res[3].Err != nil {
		t.Fatalf("results %+v", res)
	}
	if st := lookup(t, store.Scope, "s2"); st.found {
		t.Fatalf("s2 not released: %+v", st)
	}
	res, err := g.DoManyTx(ctx, items, func(ctx context.Context, tx pgx.Tx, i int) (Response, error) {
		atomic.AddInt32(&runs[i], 1)
		return Response{Status: 202}, nil
	})
	if err != nil || res[0].Outcome != Replayed || string(res[0].Response.Body) != "\x00x\x00" ||
		res[1].Outcome != Executed || res[3].Outcome != Replayed || string(res[3].Response.Body) != "\x00x\x03" {
		t.Fatalf("DoManyTx: %v %+v", err, res)
	}
	if runs[0] != 1 || runs[1] != 2 || runs[2] != 0 || runs[3] != 1 {
		t.Fatalf("runs %v", runs)
	}
}
