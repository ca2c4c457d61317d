package conformance

import (
	"context"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// fencing: with WithFencing every grant carries a token greater than every token before it, whichever Locker,
// session kind or call took it; without it Token is 0. A resource that checks the token refuses the write of a
// holder whose lock was lost (terminated, but still running) once a later holder has written.
func (s *suite) fencing(t *testing.T) {
	a, b := s.open(t, advlock.WithFencing()), s.open(t, advlock.WithFencing())
	plain, obs := s.open(t), s.observer(t)
	ctx := ctxT(t, 30*time.Second)
	k := Key(t)
	var last int64
	next := func(what string, tok int64) {
		t.Helper()
		if tok <= last {
			t.Fatalf("%s: token %d after %d, want it greater", what, tok, last)
		}
		last = tok
	}
	for i := range 12 {
		l := []*advlock.Locker{a.L, b.L}[i%2]
		var lk *advlock.Lock
		var err error
		switch i % 4 {
		case 0:
			lk, err = l.TryLock(ctx, k)
		case 1:
			lk, err = l.Lock(ctx, k)
		case 2:
			lk, err = l.RLock(ctx, k, advlock.Wait(time.Second))
		case 3:
			err = l.Do(ctx, k, func(fctx context.Context) error {
				next("Do", advlock.FenceToken(fctx))
				return nil
			})
		}
		if err != nil {
			t.Fatal(err)
		}
		if lk != nil {
			next(fmt.Sprintf("grant %d", i), lk.Token())
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if lk, err := plain.L.TryLock(ctx, k); err != nil || lk.Token() != 0 {
		t.Errorf("without fencing: %v, token %v, want 0", err, lk)
	} else {
		_ = lk.Unlock(ctx)
	}

	// The resource side.
	table := fmt.Sprintf("advlock_fence_demo_%d", time.Now().UnixNano())
	if _, err := obs.Exec(ctx, "CREATE TABLE "+table+" (id int PRIMARY KEY, fence bigint NOT NULL, value text)"); err != nil {
		t.Fatal(err)
	}
	defer obs.Exec(context.Background(), "DROP TABLE "+table)
	if _, err := obs.Exec(ctx, "INSERT INTO "+table+" VALUES (1, 0, 'none')"); err != nil {
		t.Fatal(err)
	}
	write := func(token int64, value string) int64 {
		tag, err := obs.Exec(ctx, "UPDATE "+table+" SET fence = $1, value = $2 WHERE id = 1 AND fence < $1", token, value)
		if err != nil {
			t.Fatal(err)
		}
		return tag.RowsAffected()
	}
	stale, err := a.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if write(stale.Token(), "first holder") != 1 {
		t.Fatal("the first holder's write was refused")
	}
	pgtest.Terminate(t, obs, pidOf(t, obs, k)) // the holder goes on running, unaware for a moment
	fresh, err := b.L.Lock(ctx, k, advlock.Wait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if write(fresh.Token(), "second holder") != 1 {
		t.Fatal("the second holder's write was refused")
	}
	if write(stale.Token(), "stale write") != 0 {
		t.Error("the stale holder's write was accepted after a later holder wrote")
	}
	var value string
	if err := obs.QueryRow(ctx, "SELECT value FROM "+table+" WHERE id = 1").Scan(&value); err != nil || value != "second holder" {
		t.Errorf("the resource holds %q (%v), want the second holder's write", value, err)
	}
	_ = stale.Unlock(ctx)
	if err := fresh.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// fencingFirstUse: a database that has never seen advlock (no sequence yet) and a fleet whose Lockers take their
// first fenced lock at once, through every call. Every one is granted, with distinct tokens: a concurrent CREATE
// SEQUENCE that loses the race (a duplicate in pg_class, 23505, or 42P07) means the sequence exists now.
func (s *suite) fencingFirstUse(t *testing.T) {
	obs := pgtest.Conn(t, pgtest.FreshDB(t, s.be.ObsURL))
	db := obs.Config().Database
	u, err := url.Parse(s.be.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + db // a pooler in front routes any database name (its [databases] has a wildcard)
	ctx := ctxT(t, 60*time.Second)
	const lockers, rounds = 6, 3
	failed := 0
	for round := range rounds { // a subtest each, whose end closes its Lockers' pools (a pooler's pool is small)
		t.Run(fmt.Sprintf("round %d", round), func(t *testing.T) { s.firstUses(t, ctx, obs, u.String(), lockers, &failed) })
	}
	if failed > 0 {
		t.Logf("%d of %d first uses failed", failed, lockers*rounds)
	}
}

func (s *suite) firstUses(t *testing.T, ctx context.Context, obs *pgx.Conn, url string, lockers int, failed *int) {
	{
		if _, err := obs.Exec(ctx, "DROP SEQUENCE IF EXISTS public.advlock_fence"); err != nil {
			t.Fatal(err)
		}
		var hs []Harness
		for range lockers {
			h := s.openURL(t, url, advlock.WithFencing())
			hs = append(hs, h)
		}
		start := make(chan struct{})
		tokens, errs := make([]int64, lockers), make([]error, lockers)
		var wg sync.WaitGroup
		for i, h := range hs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				k := Key(t)
				<-start
				var lk *advlock.Lock
				var err error
				switch i % 3 {
				case 0:
					lk, err = h.L.TryLock(ctx, k)
				case 1:
					lk, err = h.L.Lock(ctx, k)
				case 2:
					err = h.L.Do(ctx, k, func(fctx context.Context) error {
						tokens[i] = advlock.FenceToken(fctx)
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
				*failed++
				t.Errorf("Locker %d: first fenced lock on a fresh database: %v", i, err)
			} else if tokens[i] <= 0 || seen[tokens[i]] {
				t.Errorf("Locker %d: token %d (tokens so far %v)", i, tokens[i], seen)
			}
			seen[tokens[i]] = true
		}
		for _, h := range hs {
			h.L.Close()
		}
	}
}
