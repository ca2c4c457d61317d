package main

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/advlock/advlock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// loss measures how long a holder takes to learn that its lock is gone: advlock after pg_terminate_backend of its
// session, etcd after its session's lease is revoked, redsync (which has no notification) by a watchdog polling
// Valid every 100 ms after the key disappears (as on expiry).
func loss(ctx context.Context, e *env, col *collector, round int, leases bool) {
	obs, err := pgx.Connect(ctx, e.pgURL)
	if err != nil {
		log.Printf("loss: %v", err)
		return
	}
	defer obs.Close(ctx)

	// advlock
	pool, err := pgxpool.New(ctx, e.poolURL)
	if err == nil {
		l := advlock.New(pool)
		var lat []time.Duration
		for i := range 10 {
			k := advlock.NameKey(fmt.Sprintf("bench-loss-%d-%d-%d", round, i, time.Now().UnixNano()))
			lk, err := l.Lock(ctx, k)
			if err != nil {
				log.Printf("loss/advlock: %v", err)
				break
			}
			time.Sleep(5 * time.Millisecond)
			v, _ := k.Int64()
			var pid int32
			if err := obs.QueryRow(ctx, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
				AND ((classid::text::int8 << 32) | objid::text::int8) = $1`, v).Scan(&pid); err != nil {
				log.Printf("loss/advlock: %v", err)
				break
			}
			if _, err := obs.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
				log.Printf("loss/advlock: %v", err)
				break
			}
			t0 := time.Now()
			<-lk.Done()
			lat = append(lat, time.Since(t0))
			_ = lk.Unlock(ctx)
		}
		l.Close()
		pool.Close()
		if len(lat) > 0 {
			col.add(wLoss, "advlock Lock", "p50 after pg_terminate_backend", "ms", ms(percentile(lat, 50)), "")
		}
	}

	// etcd
	if c, err := clientv3.New(clientv3.Config{Endpoints: e.etcdURLs, DialTimeout: 5 * time.Second, Logger: zap.NewNop()}); err == nil {
		var lat []time.Duration
		for i := range 5 {
			s, err := concurrency.NewSession(c, concurrency.WithTTL(5))
			if err != nil {
				log.Printf("loss/etcd: %v", err)
				break
			}
			m := concurrency.NewMutex(s, fmt.Sprintf("/bench/loss-%d-%d", round, i))
			if err := m.Lock(ctx); err != nil {
				log.Printf("loss/etcd: %v", err)
				s.Close()
				break
			}
			t0 := time.Now()
			if _, err := c.Revoke(ctx, s.Lease()); err != nil {
				log.Printf("loss/etcd: %v", err)
			}
			<-s.Done()
			lat = append(lat, time.Since(t0))
			s.Close()
		}
		c.Close()
		if len(lat) > 0 {
			col.add(wLoss, "etcd concurrency.Mutex", "p50 after lease revoke (TTL 5s)", "ms", ms(percentile(lat, 50)), "")
		}
	}

	// redsync
	rs := redsync.New(goredis.NewPool(e.redis))
	var lat []time.Duration
	for i := range 10 {
		name := fmt.Sprintf("bench-loss-%d-%d-%d", round, i, time.Now().UnixNano())
		m := rs.NewMutex(name, redsync.WithExpiry(30*time.Second))
		if err := m.LockContext(ctx); err != nil {
			log.Printf("loss/redsync: %v", err)
			break
		}
		noticed := make(chan time.Time, 1)
		stop := make(chan struct{})
		go func() { // the watchdog a redsync user has to write
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-stop:
					return
				case <-t.C:
					if ok, err := m.ValidContext(ctx); !ok || err != nil {
						noticed <- time.Now()
						return
					}
				}
			}
		}()
		time.Sleep(time.Duration(i*7%100) * time.Millisecond) // spread the loss over the polling period
		t0 := time.Now()
		e.redis.Del(ctx, name)
		select {
		case at := <-noticed:
			lat = append(lat, at.Sub(t0))
		case <-time.After(5 * time.Second):
			log.Printf("loss/redsync: not noticed in 5s")
		}
		close(stop)
	}
	if len(lat) > 0 {
		col.add(wLoss, "redsync (Redis)", "p50 after key expiry, 100ms watchdog", "ms", ms(percentile(lat, 50)), "")
	}
	col.add(wLoss, rawName, "p50", "ms", -1, "never: learns at its next statement")
	if leases {
		leaseLoss(ctx, e, obs, col, round)
	}
}
