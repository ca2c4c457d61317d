package advlocktest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advlocktest"
	"github.com/jackc/pgx/v5"
)

// A blackhole is noticed within the keepalive bound (about twice WithKeepalive); a cut at once.
func TestLink(t *testing.T) {
	dsn := advlocktest.DSN(t)
	link := advlocktest.NewLink(t, dsn)
	const keepalive = time.Second
	l := open(t, link.DSN(), advlock.WithKeepalive(keepalive))

	lk, err := l.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatal(err)
	}
	link.Cut()
	select {
	case <-lk.Done():
	case <-time.After(keepalive): // a cut is told at once, not at the keepalive
		t.Fatal("a cut link not told within a keepalive interval")
	}

	key := newKey()
	lk, err = l.TryLock(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // watched by now
	start := time.Now()
	link.Blackhole()
	select {
	case <-lk.Done():
		if took := time.Since(start); took < keepalive/2 {
			t.Fatalf("a blackhole told after %v: that is no silent network", took)
		}
	case <-time.After(2*keepalive + 2*time.Second):
		t.Fatalf("a blackhole not told within the bound (about %v)", 2*keepalive)
	}
	if !errors.Is(lk.Err(), advlock.ErrLockLost) {
		t.Fatalf("Err: %v", lk.Err())
	}
	// Until the link is restored or closed, the server keeps the silent session and its lock: a frozen holder.
	if got := holders(t, dsn, key); len(got) != 1 {
		t.Fatalf("holders during the blackhole: %v, want the silent session", got)
	}
	link.Restore() // the Locker closed its side: restored, the link passes that on, and the server lets go
	for deadline := time.Now().Add(5 * time.Second); len(holders(t, dsn, key)) != 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the silent session still holds %s 5 s after the link was restored", key)
		}
	}

	link.Latency(100 * time.Millisecond)
	start = time.Now()
	lk, err = l.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 100*time.Millisecond {
		t.Fatalf("TryLock over 100 ms of latency took %v", took)
	}
	link.Restore()
	if err := lk.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

// A Link whose URL named the host and port as parameters still carries the Locker's traffic.
func TestLinkHostInQuery(t *testing.T) {
	dsn := advlocktest.DSN(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := fmt.Sprintf("postgres://%s@/%s?host=%s&port=%d&sslmode=disable", cfg.User, cfg.Database, cfg.Host, cfg.Port)
	link := advlocktest.NewLink(t, q)
	l := open(t, link.DSN())
	lk, err := l.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatal(err)
	}
	link.Cut()
	select {
	case <-lk.Done():
	case <-time.After(5 * time.Second):
		t.Fatalf("a cut link did not end the lock: the Locker bypassed it (%s)", link.DSN())
	}
}

// The kinds of lock a Locker hands out, and the options that give them.
var lockKinds = []kind{
	{"session locks", nil},
	{"leases", []advlock.Option{advlock.WithLeases(), advlock.WithLeaseLength(9 * time.Second)}},
}

// openBehindLink opens a Locker of kind k (and opts) on a Link to the test's server; the test closes it.
func openBehindLink(t *testing.T, k kind, opts ...advlock.Option) (dsn string, link *advlocktest.Link, l *advlock.Locker) {
	t.Helper()
	dsn = advlocktest.DSN(t)
	link = advlocktest.NewLink(t, dsn)
	l, err := advlock.Open(ctxT(t), link.DSN(), append(k.opts, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return dsn, link, l
}

// After a partition during which a call was cut short by its own ctx (what a leader's campaign does as it gives
// up), the first call once the network heals is served within one connect, and Close returns within 3 s: nothing
// waits for a request the partition held.
func TestLinkPartitionThenClose(t *testing.T) {
	for _, k := range lockKinds {
		t.Run(k.name, func(t *testing.T) {
			dsn, link, l := openBehindLink(t, k, advlock.WithKeepalive(time.Second))
			defer l.Close()
			heldKey := newKey()
			held := advlocktest.Hold(t, dsn, heldKey)
			defer held.Release()
			connect(t, l)

			link.Blackhole()
			cut, cancel := context.WithTimeout(ctxT(t), 500*time.Millisecond)
			// A wait whose statements go into the partition; its ctx ends meanwhile. (A request already sent on a
			// shared session is answered or its session declared dead: the call may end at the keepalive bound.)
			_, err := l.Lock(cut, heldKey)
			cancel()
			if err == nil {
				t.Fatal("a Lock during the partition was granted")
			}
			t.Logf("the call during the partition: %v", err)
			time.Sleep(time.Second)
			link.Restore()

			start := time.Now()
			ctx, cancel := context.WithTimeout(ctxT(t), advlock.DefaultConnectTimeout)
			defer cancel()
			lk, err := l.TryLock(ctx, newKey())
			if err != nil {
				t.Fatalf("the first call after the partition: %v (after %v)", err, time.Since(start))
			}
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("the first call after the partition took %v, want <= 3 s", took)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}

			start = time.Now()
			l.Close()
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("Close after the partition took %v, want <= 3 s", took)
			}
		})
	}
}

// Close returns within 3 s while the network is still partitioned, with a call cut short during it, and a lock
// held: its release is given up after WithReleaseTimeout.
func TestLinkCloseDuringPartition(t *testing.T) {
	for _, k := range lockKinds {
		t.Run(k.name, func(t *testing.T) {
			_, link, l := openBehindLink(t, k, advlock.WithReleaseTimeout(time.Second))
			lk, err := l.TryLock(ctxT(t), newKey())
			if err != nil {
				t.Fatal(err)
			}
			link.Blackhole()
			cut, cancel := context.WithTimeout(ctxT(t), 300*time.Millisecond)
			if _, err := l.TryLock(cut, newKey()); err == nil {
				t.Fatal("a TryLock during the partition succeeded")
			}
			cancel()
			start := time.Now()
			l.Close()
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("Close during the partition took %v, want <= 3 s (1 s of release timeout and 1 s for the pool)", took)
			}
			// Released by Close, lost to the partition, or its release not confirmed (a lease's row is then deleted
			// as soon as the server answers): never still held.
			if err := lk.Err(); !errors.Is(err, advlock.ErrClosed) && !errors.Is(err, advlock.ErrLockLost) && !errors.Is(err, advlock.ErrUnlockFailed) {
				t.Errorf("the held lock after Close: %v", err)
			}
			// The partition is still on as the test ends: the link's close delivers what it held (the release), so
			// the check for locks left held finds nothing.
		})
	}
}

// A lease lives through a partition shorter than its length: the renewal sent during it arrives late and is
// answered, the lease stays held (its row in the table, its Err nil), and its Unlock after the partition is clean.
func TestLinkPartitionKeepsLease(t *testing.T) {
	dsn := advlocktest.DSN(t)
	link := advlocktest.NewLink(t, dsn)
	l := open(t, link.DSN(), advlock.WithLeases(), advlock.WithLeaseLength(9*time.Second))
	key := newKey()
	lk, err := l.TryLock(ctxT(t), key)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond) // the partition covers the renewal due 3 s after the grant
	link.Blackhole()
	time.Sleep(2 * time.Second)
	link.Restore()
	// The renewal sent during the partition arrives now, and renews the lease for its length from now (a renewal
	// thrown away would leave it 4.5 s; the next is due 3 s after the one held).
	time.Sleep(300 * time.Millisecond)
	if left := leaseLeft(t, dsn, key); left < 7*time.Second {
		t.Fatalf("the lease ends %v after the partition, want its length (9 s) from about then: the renewal sent during it did not arrive", left)
	}
	time.Sleep(700 * time.Millisecond)
	if err := lk.Err(); err != nil {
		t.Fatalf("the lease after a 2 s partition: %v, want held", err)
	}
	if n := leaseRows(t, dsn, key); n != 1 {
		t.Fatalf("%d rows of the key in the lease table after the partition, want the holder's 1", n)
	}
	if _, err := l.TryLock(ctxT(t), key); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Fatalf("another TryLock of the key: %v, want ErrNotAcquired", err)
	}
	if err := lk.Unlock(ctxT(t)); err != nil {
		t.Fatalf("Unlock after the partition: %v", err)
	}
	if n := leaseRows(t, dsn, key); n != 0 {
		t.Fatalf("%d rows of the key in the lease table after Unlock", n)
	}
}

// leaseLeft is how long the lease of int8 key has yet to run by the server's clock.
func leaseLeft(t *testing.T, dsn string, key advlock.Key) time.Duration {
	t.Helper()
	conn, err := pgx.Connect(ctxT(t), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	v, _ := key.Int64()
	var us int64
	if err := conn.QueryRow(ctxT(t), `SELECT (extract(epoch FROM expires - clock_timestamp()) * 1e6)::int8
		FROM public.advlock_lease WHERE space = 1 AND key = $1`, v).Scan(&us); err != nil {
		t.Fatal(err)
	}
	return time.Duration(us) * time.Microsecond
}

// A call whose statement went into a partition and whose ctx ended meanwhile returns by its bound (a session per
// lock: at ctx's end; a shared session: the keepalive bound; a lease: the grant's bound, 5 s), with an error that
// says what ended it, never holding the key: once the network heals and the held statement has reached the
// server, the key is free on the server.
func TestLinkStalledCallReturnsByItsBound(t *testing.T) {
	for _, c := range []struct {
		name           string
		opts           []advlock.Option
		bound          time.Duration
		ctxErr, silent bool
	}{
		{"session per lock", []advlock.Option{advlock.WithSharedSessions(0)}, 300 * time.Millisecond, true, false},
		{"shared session", []advlock.Option{advlock.WithKeepalive(time.Second)}, time.Second, false, true},
		{"lease", []advlock.Option{advlock.WithLeases(), advlock.WithLeaseLength(9 * time.Second)}, 5 * time.Second, true, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			dsn, link, l := openBehindLink(t, kind{c.name, nil}, c.opts...)
			defer l.Close()
			connect(t, l)
			key := newKey()
			link.Blackhole()
			ctx, cancel := context.WithTimeout(ctxT(t), 300*time.Millisecond)
			start := time.Now()
			_, err := l.TryLock(ctx, key)
			took := time.Since(start)
			cancel()
			if err == nil {
				t.Fatal("a TryLock into the partition was granted")
			}
			t.Logf("returned after %v: %v", took.Round(time.Millisecond), err)
			// What ended the call: ctx (a session per lock), the server's silence (a shared session), both (a
			// lease).
			if errors.Is(err, context.DeadlineExceeded) != c.ctxErr || strings.Contains(err.Error(), "no answer") != c.silent {
				t.Errorf("the error %q: want matching the ctx's end %v, saying the server did not answer %v", err, c.ctxErr, c.silent)
			}
			if took > c.bound+2*time.Second {
				t.Errorf("returned after %v, want within its bound (%v) and 2 s", took, c.bound)
			}
			link.Restore()
			time.Sleep(time.Second) // the held statement reaches the server, and what undoes it after it
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
				conn, err := pgx.Connect(ctxT(t), dsn)
				if err != nil {
					t.Fatal(err)
				}
				rows, err := advlock.Inspect(ctxT(t), conn)
				conn.Close(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				held := false
				for _, r := range rows {
					held = held || (r.Granted && r.Key.Equal(key))
				}
				if !held {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the key of the call cut in the partition is still held 10 s after it healed: %+v", rows)
				}
			}
		})
	}
}

// connect takes a key and releases it through l: the pool's connections through the link are made.
func connect(t *testing.T, l *advlock.Locker) {
	t.Helper()
	lk, err := l.TryLock(ctxT(t), newKey())
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}
