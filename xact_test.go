package advlock

import (
	"context"
	"errors"
	neturl "net/url"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/faults"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Transaction-scoped locks: released by COMMIT, by ROLLBACK, and by ROLLBACK TO SAVEPOINT; exclusive against other
// transactions; refused nothing extra.
func TestXact(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 20*time.Second)
	for _, end := range []string{"commit", "rollback"} {
		k := key(t)
		tx, err := b.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := XactLock(ctx, tx, k); err != nil {
			t.Fatal(err)
		}
		if len(b.holders(t, k)) != 1 {
			t.Fatalf("%s: not held inside the transaction", end)
		}
		other, err := b.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := TryXactLock(ctx, other, k); !errors.Is(err, ErrNotAcquired) {
			t.Errorf("TryXactLock from another transaction: %v, want ErrNotAcquired", err)
		}
		if err := TryXactRLock(ctx, other, k); !errors.Is(err, ErrNotAcquired) {
			t.Errorf("TryXactRLock from another transaction: %v, want ErrNotAcquired", err)
		}
		if _, err := other.Exec(ctx, "SELECT 1"); err != nil {
			t.Errorf("transaction unusable after a refused try: %v", err)
		}
		_ = other.Rollback(ctx)
		if end == "commit" {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		if p := b.holders(t, k); len(p) != 0 {
			t.Errorf("still held after %s: %v", end, p)
		}
	}

	k := key(t)
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SAVEPOINT s"); err != nil {
		t.Fatal(err)
	}
	if err := XactRLock(ctx, tx, k); err != nil {
		t.Fatal(err)
	}
	if len(b.holders(t, k)) != 1 {
		t.Fatal("not held after the savepoint")
	}
	if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
		t.Fatal(err)
	}
	if p := b.holders(t, k); len(p) != 0 {
		t.Errorf("lock taken after a SAVEPOINT survived ROLLBACK TO SAVEPOINT: %v", p)
	}
	if err := XactLock(ctx, nil, k); err == nil {
		t.Error("XactLock(nil tx) succeeded")
	}
	if err := XactLock(ctx, tx, Key{}); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("zero key: %v", err)
	}
}

// A wait cut by ctx aborts the transaction; rolling back drops whatever the server granted.
func TestXactWaitCancelled(t *testing.T) {
	b := setup(t)
	k := key(t)
	holder, err := b.l.TryLock(ctxT(t, 10*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := b.pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := XactLock(ctx, tx, k); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("XactLock past its deadline: %v, want DeadlineExceeded", err)
	}
	_ = tx.Rollback(context.Background())
	if err := holder.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.waitFree(t, k)
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// One session can hold a key at session level and at transaction level at once: the holds stack (re-entrancy),
// and COMMIT ends only the transaction's. advlock never mixes them on one session: a session lock's connection is
// pinned and no transaction can run on it.
func TestSessionAndXactOnOneSession(t *testing.T) {
	url := pgtest.URL(t)
	c := pgtest.Conn(t, url)
	obs := pgtest.Conn(t, url)
	ctx := ctxT(t, 10*time.Second)
	k := key(t)
	v, _ := k.Int64()
	if _, err := c.Exec(ctx, "SELECT pg_advisory_lock($1)", v); err != nil {
		t.Fatal(err)
	}
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := TryXactLock(ctx, tx, k); err != nil {
		t.Fatalf("xact lock on the session that holds the key: %v, want granted (re-entrant)", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if p, _ := pgtest.Holders(ctx, obs, v); len(p) != 1 {
		t.Errorf("after COMMIT the session lock should remain: holders %v", p)
	}
	var ok bool
	if err := c.QueryRow(ctx, "SELECT pg_advisory_unlock($1)", v).Scan(&ok); err != nil || !ok {
		t.Fatal(ok, err)
	}
	pgtest.WaitFree(t, obs, v, 5*time.Second)
}

func TestDoTx(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)
	k := key(t)
	err := b.l.DoTx(ctx, k, func(ctx context.Context, tx pgx.Tx) error {
		if p := b.holders(t, k); len(p) != 1 {
			t.Errorf("inside DoTx: holders %v", p)
		}
		_, err := tx.Exec(ctx, "SELECT 1")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	if err := b.l.DoTx(ctx, k, func(context.Context, pgx.Tx) error { return boom }); !errors.Is(err, boom) {
		t.Errorf("DoTx = %v, want fn's error", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "panic in fn" {
				t.Errorf("recovered %v", r)
			}
		}()
		_ = b.l.DoTx(ctx, k, func(context.Context, pgx.Tx) error { panic("panic in fn") })
	}()
	b.waitFree(t, k)
	pgtest.NoIdleLocks(t, b.pool, b.obs)
	if err := New(nil).DoTx(ctx, k, nil); !errors.Is(err, ErrNoPool) {
		t.Errorf("DoTx on New(nil): %v", err)
	}
}

// A DoTx cut off by a network that drops everything (its ctx ends while fn's statement waits for an answer) gives
// its connection up at once: when the network comes back, the server sees the socket close and ends the
// transaction, which frees the key within moments. The driver's own close sent a cancel request and drained the
// socket for up to 15 s first, all that time holding the transaction, and with it the lock.
func TestDoTxAbandonedNow(t *testing.T) {
	url := pgtest.URL(t)
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	p := faults.Start(t, u.Host)
	u.Host = p.Addr()
	l := New(pgtest.Pool(t, u.String(), nil))
	defer l.Close()
	obs := pgtest.Conn(t, url)
	k := key(t)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	err = l.DoTx(ctx, k, func(ctx context.Context, tx pgx.Tx) error {
		p.Blackhole(true)
		_, err := tx.Exec(ctx, "SELECT 1")
		return err
	})
	if err == nil {
		t.Fatal("DoTx through a blackhole succeeded")
	}
	time.Sleep(time.Second) // the network stays down a while after DoTx gave up
	p.Blackhole(false)      // the network is back: the closed socket's end reaches the server
	start := time.Now()
	v, _ := k.Int64()
	pgtest.WaitFree(t, obs, v, 5*time.Second)
	t.Logf("DoTx failed (%v); its key was free %v after the network came back", err, time.Since(start).Round(time.Millisecond))
	p.Cut() // pgx's cancel request, whose packet the blackhole swallowed, waits for an answer for 15 s
}

// A transaction lock leaves its transaction without a snapshot once granted, so that the holder's own migration
// finishes: CREATE INDEX CONCURRENTLY on another connection, run inside DoTx's fn as migration tools do, waits for
// every transaction with an older snapshot, and would wait for the lock's own transaction for ever. With each of
// pgx's query modes (the extended protocol left the lock statement's portal, and its snapshot, open), and for
// XactLock in a transaction of the caller's; pg_stat_activity shows the holding backend with no backend_xmin.
func TestXactLockHoldsNoSnapshot(t *testing.T) {
	url := pgtest.MigrationDB(t, pgtest.URL(t))
	ctx := ctxT(t, 2*time.Minute)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			pool := pgtest.Pool(t, url, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			l := New(pool)
			defer l.Close()
			k := key(t)
			err := l.DoTx(ctx, k, func(ctx context.Context, tx pgx.Tx) error {
				v, _ := k.Int64()
				return pgtest.MigrateBeside(t, url, v)
			})
			if err != nil {
				t.Fatal(err)
			}
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if err := XactLock(ctx, tx, k); err != nil {
				t.Fatal(err)
			}
			v, _ := k.Int64()
			if err := pgtest.MigrateBeside(t, url, v); err != nil {
				t.Fatal(err)
			}
		})
	}
}
