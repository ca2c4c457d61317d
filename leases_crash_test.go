package advlock

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// Grants and renewals commit without waiting for their WAL to be flushed, so a crash takes back the last of them.
// Here a crash (an immediate stop) takes back a grant its holder was told of: the restarted server has no row for
// the key. Still no second holder: the first grant asked for after the crash finds the unlogged table of restarts
// emptied, records the moment, and nothing is granted for one lease length from then (without that quiet period,
// the mutant lease_no_restart_quiet, the waiter was granted while the holder still trusted its lease); and the
// waiter's term is greater than the lost grant's, although the crash took back the sequence's move past it too (a
// flushed setval just before makes the holder's draw write the sequence's next record, which the crash loses):
// without the move, the mutant lease_restart_term_kept, the waiter drew the very same term. The server's WAL
// writer flushes every 10 s here, so that what a grant wrote is still unflushed when the server is stopped. A
// waiter whose own leases are shorter (1 s) waits as long: the wait is the longest lease length ever granted, which
// a logged table keeps (with the asker's length, its waiter was granted 1 s after the restart).
func TestLeaseCrashLosesGrant(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	t.Parallel()
	for _, shorter := range []bool{false, true} {
		t.Run(map[bool]string{false: "same_length", true: "shorter_waiter"}[shorter], func(t *testing.T) {
			t.Parallel()
			crashLosesGrant(t, shorter)
		})
	}
}

func crashLosesGrant(t *testing.T, shorter bool) {
	c := pgtest.StartCluster(t, "synchronous_commit = on", "wal_writer_delay = '10s'")
	ctx := ctxT(t, 2*time.Minute)
	const length = 5 * time.Second // the holder still trusts its lease once the server is back (a restart takes about a second)
	holder := New(pgtest.Pool(t, c.URL, nil), WithLeases(), WithLeaseLength(length))
	defer holder.Close()
	warmLeases(ctx, t, holder) // the tables, made with the row that says no grant was lost before them
	var lk *Lock
	var k Key
	for attempt := 1; lk == nil; attempt++ {
		admin := pgtest.Conn(t, c.URL)
		// A commit that flushes (synchronous_commit is on for this one): the sequence's state is on disk, and its
		// next draw writes a record of its own.
		if _, err := admin.Exec(ctx, "SELECT setval('"+session.FenceSeq+"', nextval('"+session.FenceSeq+"'))"); err != nil {
			t.Fatal(err)
		}
		admin.Close(ctx)
		k = key(t)
		held, err := holder.TryLock(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Restart("immediate"); err != nil {
			t.Fatal(err)
		}
		admin = pgtest.Conn(t, c.URL)
		var rows, boots int
		if err := admin.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+lease.Table+" WHERE key = $1), (SELECT count(*) FROM "+
			lease.Boot+")", keyValue(k)).Scan(&rows, &boots); err != nil {
			t.Fatal(err)
		}
		admin.Close(ctx)
		if boots != 0 {
			t.Fatalf("the table of restarts has %d rows after a crash, want none (PostgreSQL empties an unlogged table then)", boots)
		}
		if rows == 0 {
			lk = held
			break
		}
		// The WAL writer's round came between the grant and the stop: the grant stands. Try again.
		t.Logf("attempt %d: the crash kept the grant", attempt)
		_ = held.Unlock(ctx)
		if attempt == 3 {
			t.Fatal("three crashes in a row kept the grant they came right after")
		}
	}
	select {
	case <-lk.Done():
		t.Fatalf("the holder lost its lease before the server was back: %v", lk.Err())
	default:
	}
	restarted := time.Now()
	waiterLength := length
	if shorter {
		waiterLength = time.Second
	}
	waiter := New(pgtest.Pool(t, c.URL, nil), WithLeases(), WithLeaseLength(waiterLength), withLeasePoll(5*time.Millisecond))
	defer waiter.Close()
	got, told, granted := takeover(ctx, t, waiter, k, lk, 20*time.Second)
	t.Logf("the server was back; the holder was told %v later, the waiter granted %v later",
		told.Sub(restarted).Round(time.Millisecond), granted.Sub(restarted).Round(time.Millisecond))
	if got.Token() <= lk.Token() {
		t.Errorf("the waiter's term %d is not greater than the lost grant's %d", got.Token(), lk.Token())
	}
}

// A clean restart loses nothing (the server flushes its WAL as it stops) and keeps the table of restarts: a lease
// is granted at once after it, with no quiet period, and one held across it is renewed.
func TestLeaseCleanRestartNoQuiet(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster")
	}
	t.Parallel()
	c := pgtest.StartCluster(t)
	ctx := ctxT(t, time.Minute)
	const length = 5 * time.Second // past a restart on a loaded machine
	l := New(pgtest.Pool(t, c.URL, nil), WithLeases(), WithLeaseLength(length))
	defer l.Close()
	held, err := l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Restart("fast"); err != nil {
		t.Fatal(err)
	}
	lk, err := l.TryLock(ctx, key(t))
	for err != nil && ctx.Err() == nil && !errIsQuiet(err) { // the pool's connections the restart ended
		time.Sleep(10 * time.Millisecond)
		lk, err = l.TryLock(ctx, key(t))
	}
	if err != nil {
		t.Fatalf("TryLock after a clean restart: %v, want granted at once", err)
	}
	defer lk.Unlock(ctx)
	time.Sleep(length) // past a lease length: its renewals went on
	if err := held.Err(); err != nil {
		t.Errorf("a lease held across a clean restart: %v", err)
	}
	if err := held.Unlock(ctx); err != nil {
		t.Errorf("releasing a lease held across a clean restart: %v", err)
	}
}

// errIsQuiet: a grant refused for the quiet period after a crash.
func errIsQuiet(err error) bool {
	return errors.Is(err, ErrNotAcquired) && strings.Contains(err.Error(), "started after a crash")
}

// keyValue is k's int8, as the lease table keeps it.
func keyValue(k Key) int64 { v, _ := k.Int64(); return v }
