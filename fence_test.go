package advlock

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A database that has never seen advlock, as on a fleet's first deploy: 8 Lockers (shared sessions and a session
// per lock; TryLock, Lock and Do) take their first fenced lock at the same instant, 10 times over (the sequence
// dropped between rounds). Every call succeeds and every token is distinct: CREATE SEQUENCE IF NOT EXISTS racing
// itself (23505 on pg_class) means "it exists now".
func TestFencingFirstUse(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 120*time.Second)
	const lockers, rounds = 8, 10
	failed := 0
	for round := range rounds {
		if _, err := obs.Exec(ctx, "DROP SEQUENCE IF EXISTS public.advlock_fence"); err != nil {
			t.Fatal(err)
		}
		var pools []*pgxpool.Pool
		var ls []*Locker
		for i := range lockers {
			p := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.MaxConns = 3 })
			if err := p.Ping(ctx); err != nil { // a connection ready, so that the first uses meet in the server
				t.Fatal(err)
			}
			pools = append(pools, p)
			ls = append(ls, New(p, WithFencing(), WithSharedSessions([]int{4, 0}[i%2])))
		}
		start := make(chan struct{})
		tokens := make([]int64, lockers)
		errs := make([]error, lockers)
		var wg sync.WaitGroup
		for i, l := range ls {
			wg.Add(1)
			go func() {
				defer wg.Done()
				k := key(t)
				<-start
				var lk *Lock
				var err error
				switch i % 3 {
				case 0:
					lk, err = l.TryLock(ctx, k)
				case 1:
					lk, err = l.Lock(ctx, k)
				case 2:
					err = l.Do(ctx, k, func(ctx context.Context) error {
						tokens[i] = FenceToken(ctx)
						return nil
					})
				}
				if lk != nil {
					tokens[i] = lk.Token()
					err = lk.Unlock(ctx)
				}
				errs[i] = err
			}()
		}
		close(start)
		wg.Wait()
		seen := map[int64]bool{}
		for i, err := range errs {
			if err != nil {
				failed++
				t.Errorf("round %d, Locker %d: first fenced lock on a fresh database: %v", round, i, err)
				continue
			}
			if tokens[i] <= 0 || seen[tokens[i]] {
				t.Errorf("round %d, Locker %d: token %d (tokens so far %v)", round, i, tokens[i], seen)
			}
			seen[tokens[i]] = true
		}
		for i, l := range ls {
			l.Close()
			pools[i].Close()
		}
	}
	t.Logf("%d of %d first uses failed", failed, lockers*rounds)
}
