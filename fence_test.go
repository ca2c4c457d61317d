package advlock

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
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

// A round trip of a fenced shared session that fails for another reason than lock-table space (here the token's
// nextval cannot get the sequence's lock within the database's lock_timeout while another session alters the
// sequence) puts the session in doubt: it is closed, and every caller whose request was in that round trip gets an
// error, none waits for ever, and the Locker goes on working afterwards (TestMuxRoundTripFails holds such a round
// trip at the moment it is settled).
func TestFencedRoundTripFails(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 60*time.Second)
	name := url[strings.LastIndex(url, "/")+1:]
	if i := strings.IndexByte(name, '?'); i >= 0 {
		name = name[:i]
	}
	if _, err := obs.Exec(ctx, "ALTER DATABASE "+name+" SET lock_timeout = '300ms'"); err != nil {
		t.Fatal(err)
	}
	l := New(pgtest.Pool(t, url, nil), WithFencing(), WithSharedSessions(1))
	defer l.Close()
	warm, err := l.TryLock(ctx, key(t)) // the sequence exists, the shared session is open
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Unlock(ctx)
	tx, err := obs.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "ALTER SEQUENCE public.advlock_fence INCREMENT BY 1"); err != nil {
		t.Fatal(err)
	}
	committed := make(chan struct{})
	time.AfterFunc(time.Second, func() { _ = tx.Commit(context.Background()); close(committed) })
	defer func() { <-committed }() // before obs closes (a loaded machine may commit after the callers stop)
	stop := time.Now().Add(2 * time.Second)
	var wg sync.WaitGroup
	var failed, ok atomic.Int64
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				lk, err := l.TryLock(ctx, key(t))
				if err != nil {
					failed.Add(1)
					continue
				}
				ok.Add(1)
				_ = lk.Unlock(ctx)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("callers of a fenced round trip that failed still wait 13 s after the sequence was free again")
	}
	t.Logf("%d grants, %d failed tries", ok.Load(), failed.Load())
	if failed.Load() == 0 || ok.Load() == 0 {
		t.Errorf("the round trips never failed (%d) or never worked (%d)", failed.Load(), ok.Load())
	}
}

// FenceSQL's advlock_fence accepts a token at least as large as the largest accepted for its resource, refuses a
// smaller one, and two holders racing never both pass while the first one's transaction is open.
func TestFenceSQL(t *testing.T) {
	c := pgtest.Conn(t, pgtest.FreshDB(t, pgtest.URL(t)))
	ctx := ctxT(t, 30*time.Second)
	for range 2 { // idempotent
		if _, err := c.Exec(ctx, FenceSQL); err != nil {
			t.Fatal(err)
		}
	}
	fence := func(q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}, res string, token int64) bool {
		var ok bool
		if err := q.QueryRow(ctx, "SELECT advlock_fence($1, $2)", res, token).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	for _, step := range []struct {
		res   string
		token int64
		want  bool
	}{{"a", 10, true}, {"a", 10, true}, {"a", 9, false}, {"a", 11, true}, {"b", 1, true}, {"a", 10, false}} {
		if got := fence(c, step.res, step.token); got != step.want {
			t.Errorf("advlock_fence(%q, %d) = %v, want %v", step.res, step.token, got, step.want)
		}
	}
	// A later holder (token 20) passes first and keeps its transaction open; the earlier one (token 15) waits for
	// it and is refused once it commits.
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !fence(tx, "a", 20) {
		t.Fatal("token 20 refused")
	}
	late := make(chan bool, 1)
	c2 := pgtest.Conn(t, c.Config().ConnString())
	go func() { late <- fence(c2, "a", 15) }()
	time.Sleep(200 * time.Millisecond)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if <-late {
		t.Error("token 15 accepted after token 20 committed")
	}
}

// A fencing sequence whose values would not come out in grant order is refused, with what to run: CACHE n > 1
// (each session draws from a block of its own: a later grant on another session got a smaller token), a
// decreasing one, a cycling one. Nothing is locked; once fixed, the next call works.
func TestFencingSequenceOrder(t *testing.T) {
	url := pgtest.FreshDB(t, pgtest.URL(t))
	ctx := ctxT(t, 30*time.Second)
	admin := pgtest.Conn(t, url)
	for _, tc := range []struct{ create, want, fix string }{
		{"CREATE SEQUENCE public.advlock_fence CACHE 10", "CACHE 10", "ALTER SEQUENCE public.advlock_fence CACHE 1"},
		{"CREATE SEQUENCE public.advlock_fence INCREMENT -1", "INCREMENT", "ALTER SEQUENCE public.advlock_fence INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 RESTART WITH 1"},
		{"CREATE SEQUENCE public.advlock_fence CYCLE", "CYCLE", "ALTER SEQUENCE public.advlock_fence NO CYCLE"},
	} {
		if _, err := admin.Exec(ctx, "DROP SEQUENCE IF EXISTS public.advlock_fence; "+tc.create); err != nil {
			t.Fatal(err)
		}
		l := New(pgtest.Pool(t, url, nil), WithFencing())
		k := key(t)
		if _, err := l.TryLock(ctx, k); !errors.Is(err, ErrFencing) || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("%s: TryLock: %v, want ErrFencing naming %s", tc.create, err, tc.want)
		}
		if pids, err := pgtest.Holders(ctx, admin, k.id.V); err != nil || len(pids) != 0 {
			t.Fatalf("%s: the refused key is held by %v (%v)", tc.create, pids, err)
		}
		if _, err := admin.Exec(ctx, tc.fix); err != nil {
			t.Fatal(err)
		}
		lk, err := l.TryLock(ctx, k)
		if err != nil {
			t.Fatalf("after %s: %v", tc.fix, err)
		}
		_ = lk.Unlock(ctx)
		l.Close()
	}
}
