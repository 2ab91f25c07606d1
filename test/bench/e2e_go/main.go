// End to end in Go (make bench, rows 7): the three patterns of
// test/bench/e2e.py, through pgx v4 and redigo, from one process whose
// WORKERS goroutines share one pgxpool (and one redigo pool) of WORKERS
// connections, as a Go service would.
//
//   - idem: the Go client's DoTx: claim, the order INSERT and complete in
//     one transaction.
//   - table: a hand-written key table in the same transaction: INSERT ...
//     ON CONFLICT DO NOTHING RETURNING, the order INSERT, an UPDATE of the
//     stored response; a replay reads the stored response.
//   - redis: SET key NX GET PX (one round trip: claimed, or the stored
//     value), the order INSERT (autocommit), SET key response PX.
//
// Each round runs, for each pattern in turn, new keys then replays of the
// same keys.  Prints, per pattern and phase, "pattern phase
// requests_per_s server_cpu_us_per_request rps_spread
// client_cpu_us_per_request" (medians of the rounds; server CPU: the
// cluster's processes and Redis, from /proc; client CPU: this process's,
// from getrusage).  Exits 1 if a replay differs from the first response or
// a key made other than one order.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gomodule/redigo/redis"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"

	"idem/clients/go/idempotency"
)

const bodyFormat = `{"order":"%d","status":"accepted","amount":4200,"currency":"EUR","items":[1,2,3]}`
const ttl = 86400000 // ms

var patterns = []string{"idem", "table", "redis"}
var phases = []string{"new", "replay"}

type env struct {
	pool  *pgxpool.Pool
	rpool *redis.Pool
	guard *idempotency.Guard
}

func insertOrder(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...interface{}) pgx.Row
}, key string) ([]byte, error) {
	var id int64
	if err := q.QueryRow(ctx, "INSERT INTO e2e_orders (key, amount) VALUES ($1, 4200) RETURNING id", key).Scan(&id); err != nil {
		return nil, err
	}
	return []byte(fmt.Sprintf(bodyFormat, id)), nil
}

func (e *env) idem(ctx context.Context, key string) ([]byte, error) {
	resp, _, err := e.guard.DoTx(ctx, key, "amount=4200", func(ctx context.Context, tx pgx.Tx) (idempotency.Response, error) {
		body, err := insertOrder(ctx, tx, key)
		if err != nil {
			return idempotency.Response{}, err
		}
		return idempotency.Response{Status: 201, Body: body}, nil
	})
	return resp.Body, err
}

func (e *env) table(ctx context.Context, key string) ([]byte, error) {
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(ctx)
	var claimed bool
	var body []byte
	err = tx.QueryRow(ctx, "INSERT INTO e2e_keys (key) VALUES ($1) ON CONFLICT DO NOTHING RETURNING true", key).Scan(&claimed)
	if err == pgx.ErrNoRows {
		if err = tx.QueryRow(ctx, "SELECT body FROM e2e_keys WHERE key = $1", key).Scan(&body); err != nil {
			return nil, err
		}
		return body, tx.Commit(ctx)
	} else if err != nil {
		return nil, err
	}
	if body, err = insertOrder(ctx, tx, key); err != nil {
		return nil, err
	}
	if _, err = tx.Exec(ctx, "UPDATE e2e_keys SET status = 201, body = $1 WHERE key = $2", body, key); err != nil {
		return nil, err
	}
	return body, tx.Commit(ctx)
}

func (e *env) redis(ctx context.Context, key string) ([]byte, error) {
	c := e.rpool.Get()
	defer c.Close()
	old, err := redis.Bytes(c.Do("SET", key, "processing", "NX", "GET", "PX", ttl))
	if err == nil {
		return old, nil // set already: its value
	} else if err != redis.ErrNil {
		return nil, err
	}
	body, err := insertOrder(ctx, e.pool, key)
	if err != nil {
		return nil, err
	}
	if _, err = c.Do("SET", key, body, "PX", ttl); err != nil {
		return nil, err
	}
	return body, nil
}

// serverTicks: CPU ticks used so far by the cluster's processes and Redis.
func serverTicks(dataDir string, redisPid int) int64 {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		panic(err)
	}
	ppid, _ := strconv.Atoi(strings.SplitN(string(b), "\n", 2)[0])
	ents, _ := os.ReadDir("/proc")
	var total int64
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile("/proc/" + ent.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(stat)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		parent, _ := strconv.Atoi(f[1])
		if pid == ppid || pid == redisPid || parent == ppid {
			u, _ := strconv.ParseInt(f[11], 10, 64)
			st, _ := strconv.ParseInt(f[12], 10, 64)
			total += u + st
		}
	}
	return total
}

func clientCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "e2e go: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	dsn := flag.String("dsn", "", "libpq conninfo")
	redisPort := flag.Int("redis-port", 0, "")
	redisPid := flag.Int("redis-pid", 0, "")
	workers := flag.Int("workers", 8, "")
	requests := flag.Int("requests", 2000, "")
	rounds := flag.Int("rounds", 3, "")
	flag.Parse()
	ctx := context.Background()

	cfg, err := pgxpool.ParseConfig(*dsn)
	if err != nil {
		fail("%v", err)
	}
	cfg.MaxConns, cfg.MinConns = int32(*workers), int32(*workers)
	pool, err := pgxpool.ConnectConfig(ctx, cfg)
	if err != nil {
		fail("%v", err)
	}
	defer pool.Close()
	var dataDir string
	if err = pool.QueryRow(ctx, "SHOW data_directory").Scan(&dataDir); err != nil {
		fail("%v", err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", *redisPort)
	rpool := &redis.Pool{MaxIdle: *workers, MaxActive: *workers, Wait: true,
		Dial: func() (redis.Conn, error) { return redis.Dial("tcp", addr) }}
	defer rpool.Close()
	e := &env{pool: pool, rpool: rpool,
		guard: &idempotency.Guard{Store: idempotency.NewPostgresStore(pool)}}
	handlers := map[string]func(context.Context, string) ([]byte, error){
		"idem": e.idem, "table": e.table, "redis": e.redis}

	// keys of this run only, whatever the tables or Redis hold already
	run := fmt.Sprintf("go-%x", time.Now().UnixMilli())
	type result struct{ rps, server, client float64 }
	results := map[string][]result{}
	tick := 100.0 // USER_HZ on Linux
	n := *workers * *requests
	for r := 0; r < *rounds; r++ {
		for _, p := range patterns {
			first := make([][][]byte, *workers)
			for w := range first {
				first[w] = make([][]byte, *requests)
			}
			// warm: every connection of the pool open, statements prepared
			// by a request on keys of their own
			for w := 0; w < *workers; w++ {
				if _, err := handlers[p](ctx, fmt.Sprintf("warm-%s-%s%d-%d", run, p, r, w)); err != nil {
					fail("%s: %v", p, err)
				}
			}
			for _, ph := range phases {
				s0, c0, t0 := serverTicks(dataDir, *redisPid), clientCPU(), time.Now()
				var wg sync.WaitGroup
				errs := make(chan error, *workers)
				for w := 0; w < *workers; w++ {
					wg.Add(1)
					go func(w int) {
						defer wg.Done()
						for i := 0; i < *requests; i++ {
							key := fmt.Sprintf("%s-%s%d-%d-%d", run, p, r, w, i)
							body, err := handlers[p](ctx, key)
							if err != nil {
								errs <- fmt.Errorf("%s %s %s: %v", p, ph, key, err)
								return
							}
							if ph == "new" {
								first[w][i] = body
							} else if string(body) != string(first[w][i]) {
								errs <- fmt.Errorf("%s: the replay of %s differs: %q, first %q", p, key, body, first[w][i])
								return
							}
						}
					}(w)
				}
				wg.Wait()
				el := time.Since(t0).Seconds()
				c1, s1 := clientCPU(), serverTicks(dataDir, *redisPid)
				close(errs)
				for err := range errs {
					fail("%v", err)
				}
				results[p+" "+ph] = append(results[p+" "+ph], result{
					rps:    float64(n) / el,
					server: float64(s1-s0) * 1e6 / tick / float64(n),
					client: float64((c1 - c0).Microseconds()) / float64(n)})
			}
		}
	}
	// every request of every round made exactly one order
	var dup, total int64
	if err = pool.QueryRow(ctx, "SELECT count(*) FROM (SELECT key FROM e2e_orders WHERE key LIKE $1 GROUP BY key HAVING count(*) > 1) d", run+"-%").Scan(&dup); err != nil {
		fail("%v", err)
	}
	if err = pool.QueryRow(ctx, "SELECT count(*) FROM e2e_orders WHERE key LIKE $1", run+"-%").Scan(&total); err != nil {
		fail("%v", err)
	}
	if want := int64(*rounds * len(patterns) * n); dup != 0 || total != want {
		fail("%d orders for %d requests, %d keys with more than one", total, want, dup)
	}
	for _, p := range patterns {
		for _, ph := range phases {
			var rps, server, client []float64
			for _, v := range results[p+" "+ph] {
				rps, server, client = append(rps, v.rps), append(server, v.server), append(client, v.client)
			}
			m := median(rps)
			lo, hi := rps[0], rps[0]
			for _, v := range rps {
				if v < lo {
					lo = v
				}
				if v > hi {
					hi = v
				}
			}
			fmt.Printf("%s %s %.0f %.1f %.3f %.1f\n", p, ph, m, median(server), (hi-lo)/m, median(client))
		}
	}
}
