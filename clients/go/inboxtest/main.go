// Command inboxtest is the broker kill test of the Go client's Inbox
// (clients/go/inbox_kill.sh runs it): a consumer of a RabbitMQ queue or a
// Redis stream whose handler writes one row per message into a table
// without a unique constraint, and a driver that publishes N messages,
// kills the consumer with SIGKILL at random points, between its handler
// and its commit and between its commit and its ack, many times,
// restarting it each time, and then checks that every message's effect
// is in the table exactly once and that every message was acked.
//
//	inboxtest consume -broker rabbitmq|redis -addr ADDR -dsn DSN [-idle-exit]
//	inboxtest drive -broker rabbitmq|redis -addr ADDR -dsn DSN -consumer PATH -n 1000 -kills 200
//
// The consumer pauses (and prints "paused POINT") where IDEM_INBOX_PAUSE
// says (handler: after the last handler of a batch, before the commit;
// commit: after the commit, before the ack), in the batch numbered
// IDEM_INBOX_PAUSE_BATCH (from 0); the driver kills it there.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gomodule/redigo/redis"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"idem/clients/go/idempotency"
)

const (
	queue  = "idem-inbox-test"
	group  = "idem-inbox-group"
	schema = "inbox_kill"
)

var (
	broker   = flag.String("broker", "", "rabbitmq or redis")
	addr     = flag.String("addr", "", "amqp:// URL or host:port of redis")
	dsn      = flag.String("dsn", "", "PostgreSQL connection string")
	batch    = flag.Int("batch", 5, "messages per batch")
	idleExit = flag.Bool("idle-exit", false, "consume: exit once the queue is empty and nothing is pending")
	consumer = flag.String("consumer", "", "drive: the consumer binary")
	total    = flag.Int("n", 1000, "drive: messages")
	kills    = flag.Int("kills", 200, "drive: kills of the consumer")
	delay    = flag.Duration("delay", 0, "consume: how long each handler takes")
	run      = flag.String("run", "", "the run's name: the inbox's queue (its scope) is BROKER/RUN")
	failRate = flag.Float64("fail-rate", 0.02, "consume: the share of handler calls that fail")
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: inboxtest consume|drive [flags]")
		os.Exit(2)
	}
	mode := os.Args[1]
	flag.CommandLine.Parse(os.Args[2:])
	rand.Seed(time.Now().UnixNano() ^ int64(os.Getpid()))
	var err error
	switch mode {
	case "consume":
		err = consume()
	case "drive":
		err = drive()
	default:
		err = fmt.Errorf("unknown mode %q", mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "inboxtest:", err)
		os.Exit(1)
	}
}

// The consumer.

// delivered is one message with the way to ack or give it back.
type delivered struct {
	msg  idempotency.Message
	ack  func() error
	nack func() error
}

// source fetches batches from a broker; nil, nil when idle.
type source interface {
	fetch(n int) ([]delivered, error)
	drained() (bool, error)
}

func pauseAt(point string, batchNo int) {
	if os.Getenv("IDEM_INBOX_PAUSE") != point {
		return
	}
	if n, _ := strconv.Atoi(os.Getenv("IDEM_INBOX_PAUSE_BATCH")); n != batchNo {
		return
	}
	fmt.Printf("paused %s\n", point)
	os.Stdout.Sync()
	select {} // until killed
}

func consume() error {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(*dsn)
	if err != nil {
		return err
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	var src source
	switch *broker {
	case "rabbitmq":
		src, err = newRabbit()
	case "redis":
		src, err = newRedis()
	default:
		err = fmt.Errorf("unknown broker %q", *broker)
	}
	if err != nil {
		return err
	}
	in := &idempotency.Inbox{Store: idempotency.NewPostgresStore(pool), Queue: *broker + "/" + *run}
	pid := os.Getpid()
	idle := time.Time{}
	for batchNo := 0; ; {
		ds, err := src.fetch(*batch)
		if err != nil {
			return err
		}
		if len(ds) == 0 {
			if *idleExit {
				done, err := src.drained()
				if err != nil {
					return err
				}
				if done && !idle.IsZero() && time.Since(idle) > time.Second {
					return nil
				}
				if idle.IsZero() {
					idle = time.Now()
				}
			}
			continue
		}
		idle = time.Time{}
		msgs := make([]idempotency.Message, len(ds))
		for i, d := range ds {
			msgs[i] = d.msg
		}
		handled := 0
		res, err := in.Consume(ctx, msgs, func(ctx context.Context, tx pgx.Tx, m idempotency.Message) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+schema+"."+*broker+"_effects (msg_id, consumer) VALUES ($1, $2)", m.ID, pid); err != nil {
				return err
			}
			time.Sleep(*delay)
			if handled++; handled == 1 {
				pauseAt("handler", batchNo)
			}
			if rand.Float64() < *failRate {
				return errors.New("the handler fails after its write")
			}
			return nil
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "batch failed:", err)
			for _, d := range ds {
				d.nack()
			}
			continue
		}
		pauseAt("commit", batchNo)
		for i, d := range ds {
			if res[i].Ack {
				err = d.ack()
			} else {
				err = d.nack()
			}
			if err != nil {
				return err
			}
		}
		batchNo++
	}
}

// RabbitMQ.

type rabbit struct {
	conn *amqp.Connection
	ch   *amqp.Channel
	in   <-chan amqp.Delivery
}

func newRabbit() (*rabbit, error) {
	conn, err := amqp.Dial(*addr)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Qos(*batch, 0, false); err != nil {
		return nil, err
	}
	in, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return nil, err
	}
	return &rabbit{conn: conn, ch: ch, in: in}, nil
}

func (r *rabbit) fetch(n int) ([]delivered, error) {
	var out []delivered
	timeout := time.After(200 * time.Millisecond)
	for len(out) < n {
		select {
		case d, ok := <-r.in:
			if !ok {
				return nil, errors.New("the channel closed")
			}
			out = append(out, delivered{
				msg:  idempotency.Message{ID: d.MessageId, Body: d.Body},
				ack:  func() error { return d.Ack(false) },
				nack: func() error { return d.Nack(false, true) },
			})
			if len(out) == 1 {
				timeout = time.After(20 * time.Millisecond)
			}
		case <-timeout:
			return out, nil
		}
	}
	return out, nil
}

func (r *rabbit) drained() (bool, error) {
	q, err := r.ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	return err == nil && q.Messages == 0, err
}

// Redis streams.

type redisSrc struct {
	c    redis.Conn
	name string
}

func newRedis() (*redisSrc, error) {
	c, err := redis.Dial("tcp", *addr)
	if err != nil {
		return nil, err
	}
	return &redisSrc{c: c, name: fmt.Sprintf("consumer-%d", os.Getpid())}, nil
}

// entries turns a stream reply ([[id, [field, value, ...]], ...]) into
// messages.
func (r *redisSrc) entries(reply interface{}) ([]delivered, error) {
	items, err := redis.Values(reply, nil)
	if err != nil {
		return nil, err
	}
	var out []delivered
	for _, it := range items {
		e, err := redis.Values(it, nil)
		if err != nil || len(e) != 2 {
			continue
		}
		id, _ := redis.String(e[0], nil)
		fields, _ := redis.StringMap(e[1], nil)
		if fields == nil {
			// Deleted meanwhile: ack it away.
			r.c.Do("XACK", queue, group, id)
			continue
		}
		id2 := id
		out = append(out, delivered{
			msg:  idempotency.Message{ID: fields["id"], Body: []byte(fields["body"])},
			ack:  func() error { _, err := r.c.Do("XACK", queue, group, id2); return err },
			nack: func() error { return nil }, // stays pending; XAUTOCLAIM takes it back
		})
	}
	return out, nil
}

func (r *redisSrc) fetch(n int) ([]delivered, error) {
	// First the messages a dead consumer (or a failed handler) left
	// pending for 300 ms.
	reply, err := redis.Values(r.c.Do("XAUTOCLAIM", queue, group, r.name, 300, "0-0", "COUNT", n))
	if err != nil {
		return nil, err
	}
	if len(reply) >= 2 {
		ds, err := r.entries(reply[1])
		if err != nil || len(ds) > 0 {
			return ds, err
		}
	}
	rep, err := r.c.Do("XREADGROUP", "GROUP", group, r.name, "COUNT", n, "BLOCK", 100, "STREAMS", queue, ">")
	if err != nil || rep == nil {
		return nil, err
	}
	streams, err := redis.Values(rep, nil)
	if err != nil || len(streams) == 0 {
		return nil, err
	}
	s, err := redis.Values(streams[0], nil)
	if err != nil || len(s) != 2 {
		return nil, err
	}
	return r.entries(s[1])
}

func (r *redisSrc) drained() (bool, error) {
	pending, lag, err := redisGroup(r.c)
	return err == nil && pending == 0 && lag == 0, err
}

// redisGroup answers the group's pending count and lag (entries not yet
// delivered).
func redisGroup(c redis.Conn) (int64, int64, error) {
	groups, err := redis.Values(c.Do("XINFO", "GROUPS", queue))
	if err != nil {
		return 0, 0, err
	}
	for _, g := range groups {
		m, err := redis.Values(g, nil)
		if err != nil {
			return 0, 0, err
		}
		var name string
		var pending, lag int64 = 0, -1
		for i := 0; i+1 < len(m); i += 2 {
			k, _ := redis.String(m[i], nil)
			switch k {
			case "name":
				name, _ = redis.String(m[i+1], nil)
			case "pending":
				pending, _ = redis.Int64(m[i+1], nil)
			case "lag":
				lag, _ = redis.Int64(m[i+1], nil)
			}
		}
		if name == group {
			return pending, lag, nil
		}
	}
	return 0, 0, fmt.Errorf("no group %s on %s", group, queue)
}

// The driver.

func drive() error {
	ctx := context.Background()
	pool, err := pgxpool.Connect(ctx, *dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	table := schema + "." + *broker + "_effects"
	if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+schema+"; DROP TABLE IF EXISTS "+table+
		"; CREATE TABLE "+table+" (msg_id text NOT NULL, consumer integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		return err
	}
	if err := publish(); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	*run = fmt.Sprintf("%s-%d", queue, time.Now().UnixNano())
	counts := map[string]int{}
	t0 := time.Now()
	for k := 0; k < *kills; k++ {
		point := []string{"handler", "commit", "random"}[rand.Intn(3)]
		cmd := exec.Command(*consumer, "consume", "-broker", *broker, "-addr", *addr, "-dsn", *dsn, "-run", *run,
			"-batch", strconv.Itoa(*batch), "-fail-rate", fmt.Sprint(*failRate), "-delay", "20ms")
		cmd.Env = append(os.Environ(), "IDEM_INBOX_PAUSE=", "IDEM_INBOX_PAUSE_BATCH=")
		if point != "random" {
			cmd.Env = append(cmd.Env, "IDEM_INBOX_PAUSE="+point, "IDEM_INBOX_PAUSE_BATCH="+strconv.Itoa(rand.Intn(2)))
		}
		cmd.Stderr = os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return err
		}
		if err := cmd.Start(); err != nil {
			return err
		}
		paused := make(chan string, 1)
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "paused ") {
					paused <- strings.TrimPrefix(sc.Text(), "paused ")
				}
			}
		}()
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		var wait <-chan time.Time
		if point == "random" {
			wait = time.After(time.Duration(20+rand.Intn(80)) * time.Millisecond)
		} else {
			wait = time.After(time.Second) // the queue ran dry before the pause
		}
		select {
		case p := <-paused:
			counts["at "+p]++
		case <-wait:
			if point == "random" {
				counts["at random times"]++
			} else {
				counts["at random times (no batch left to pause in)"]++
			}
		case err := <-exited:
			return fmt.Errorf("the consumer exited before it was killed: %v", err)
		}
		syscall.Kill(cmd.Process.Pid, syscall.SIGKILL)
		<-exited
	}
	var doneBefore int
	pool.QueryRow(ctx, "SELECT count(DISTINCT msg_id) FROM "+table).Scan(&doneBefore)
	// The last consumer runs until the queue is empty.
	cmd := exec.Command(*consumer, "consume", "-broker", *broker, "-addr", *addr, "-dsn", *dsn, "-run", *run,
		"-batch", strconv.Itoa(*batch), "-fail-rate", fmt.Sprint(*failRate), "-idle-exit")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("the last consumer: %v", err)
		}
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		return errors.New("the last consumer did not empty the queue in 60 s")
	}
	var n, distinct int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT msg_id) FROM "+table).Scan(&n, &distinct); err != nil {
		return err
	}
	unacked, err := unackedCount()
	if err != nil {
		return err
	}
	var ids int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE msg_id ~ '^m-[0-9]{5}$' AND substr(msg_id, 3)::int < $1", *total).Scan(&ids); err != nil {
		return err
	}
	dup, lost := n-distinct, *total-distinct
	var kinds []string
	for _, k := range []string{"at handler", "at commit", "at random times", "at random times (no batch left to pause in)"} {
		if counts[k] > 0 {
			kinds = append(kinds, fmt.Sprintf("%d %s", counts[k], k))
		}
	}
	fmt.Printf("# %s: kills: %s; %d of %d messages done when the kills ended; %.1f s\n",
		*broker, strings.Join(kinds, ", "), doneBefore, *total, time.Since(t0).Seconds())
	line := fmt.Sprintf("%s: %d kills, %d messages, %d duplicated effects, %d lost, %d not acked",
		*broker, *kills, *total, dup, lost, unacked)
	if dup != 0 || lost != 0 || unacked != 0 || n != *total || ids != *total {
		fmt.Printf("not ok - %s (effects %d, distinct %d)\n", line, n, distinct)
		return errors.New("the inbox lost or duplicated an effect")
	}
	fmt.Printf("ok - %s\n", line)
	return nil
}

func publish() error {
	switch *broker {
	case "rabbitmq":
		var conn *amqp.Connection
		var err error
		for i := 0; i < 600; i++ { // the broker may still be starting
			if conn, err = amqp.Dial(*addr); err == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			return err
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		ch.QueueDelete(queue, false, false, false)
		if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
			return err
		}
		for i := 0; i < *total; i++ {
			if err := ch.Publish("", queue, false, false, amqp.Publishing{
				MessageId: fmt.Sprintf("m-%05d", i), Body: []byte(fmt.Sprintf("body %d", i)),
			}); err != nil {
				return err
			}
		}
		return nil
	case "redis":
		c, err := redis.Dial("tcp", *addr)
		if err != nil {
			return err
		}
		defer c.Close()
		c.Do("DEL", queue)
		for i := 0; i < *total; i++ {
			if _, err := c.Do("XADD", queue, "*", "id", fmt.Sprintf("m-%05d", i), "body", fmt.Sprintf("body %d", i)); err != nil {
				return err
			}
		}
		_, err = c.Do("XGROUP", "CREATE", queue, group, "0")
		return err
	}
	return fmt.Errorf("unknown broker %q", *broker)
}

// unackedCount is the number of messages the broker still holds: ready or
// unacked in the queue (RabbitMQ), pending or never delivered (Redis).
func unackedCount() (int, error) {
	switch *broker {
	case "rabbitmq":
		conn, err := amqp.Dial(*addr)
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return 0, err
		}
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return q.Messages, err
	case "redis":
		c, err := redis.Dial("tcp", *addr)
		if err != nil {
			return 0, err
		}
		defer c.Close()
		pending, lag, err := redisGroup(c)
		return int(pending + lag), err
	}
	return 0, nil
}
