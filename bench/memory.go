package main

import (
	"context"
	"fmt"
	"log"
	"runtime"
	"time"

	"github.com/jackc/pgx/v5"
)

// memory measures heap bytes and allocations per acquire+release on one client.
func memory(ctx context.Context, c contender, tag string) (float64, float64, error) {
	cl, closeAll, err := newClients(ctx, c, 1)
	if err != nil {
		return 0, 0, err
	}
	defer closeAll()
	n := 2000
	if !c.pg {
		n = 300
	}
	cycle := func() error { return cl[0].cycle(ctx, tag, nil) }
	for range 20 {
		if err := cycle(); err != nil {
			return 0, 0, err
		}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range n {
		if err := cycle(); err != nil {
			return 0, 0, err
		}
	}
	runtime.ReadMemStats(&after)
	return float64(after.TotalAlloc-before.TotalAlloc) / float64(n), float64(after.Mallocs-before.Mallocs) / float64(n), nil
}

// held measures memory per held lock and the server connections used to hold locks at once.
func held(ctx context.Context, e *env, cs []contender, col *collector) {
	obs, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		return
	}
	defer obs.Close(ctx)
	// pgHolders counts the server sessions holding the keys of a held() run (their names start with tag).
	pgHolders := func(tag string) int {
		var n int
		var keys []int64
		for i := range 5000 {
			keys = append(keys, pgKey(fmt.Sprintf("%s-%d", tag, i)))
		}
		_ = obs.QueryRow(ctx, `SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted
			AND objsubid = 1 AND ((classid::text::int8 << 32) | objid::text::int8) = ANY($1)`, keys).Scan(&n)
		return n
	}
	redisConns := func() int {
		info, _ := e.redis.Info(ctx, "clients").Result()
		var n int
		for _, line := range splitLines(info) {
			if _, err := fmt.Sscanf(line, "connected_clients:%d", &n); err == nil {
				return n
			}
		}
		return 0
	}
	for _, c := range cs {
		if c.name == "advlock TryLock" || c.name == "advlock Do" {
			continue // same sessions as advlock Lock
		}
		m := 1000
		switch {
		case c.shares:
			m = 5000 // shared sessions: thousands on a few connections
		case c.pg && c.name != rawName:
			m = 50 // one connection per held lock; 1,000 would exceed max_connections
		}
		connsBefore := 0
		if !c.pg {
			connsBefore = redisConns()
		}
		cl, closeAll, err := newClients(ctx, c, 1)
		if err != nil {
			log.Printf("held/%s: %v", c.name, err)
			continue
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		var unlocks []func(context.Context) error
		tag := fmt.Sprintf("held-%d", time.Now().UnixNano())
		for i := range m {
			un, err := cl[0].lock(ctx, fmt.Sprintf("%s-%d", tag, i))
			if err != nil {
				log.Printf("held/%s: %v", c.name, err)
				break
			}
			unlocks = append(unlocks, un)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		conns := pgHolders(tag)
		note := fmt.Sprintf("%d connections for %d locks", conns, len(unlocks))
		switch {
		case c.name == "etcd concurrency.Mutex":
			note = "one gRPC connection per client"
			conns = -1
		case !c.pg:
			conns = redisConns() - connsBefore
			note = fmt.Sprintf("%d new connections for %d locks", conns, len(unlocks))
		}
		if len(unlocks) > 0 {
			perLock := max(0, float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/float64(len(unlocks)))
			col.add(wMemory, c.name, "heap per held lock", "B", perLock, "")
			per := float64(conns) / float64(len(unlocks))
			if conns < 0 {
				per = -1
			}
			col.add(wMemory, c.name, "server connections per held lock", "conns", per, note)
		}
		for _, un := range unlocks {
			_ = un(ctx)
		}
		closeAll()
	}
}

func splitLines(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			out = append(out, trimCR(s[start:i]))
			start = i + 1
		}
	}
	return append(out, trimCR(s[start:]))
}

func trimCR(s string) string {
	if len(s) > 0 && s[len(s)-1] == '\r' {
		return s[:len(s)-1]
	}
	return s
}
