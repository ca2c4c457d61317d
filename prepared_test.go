package advlock_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/conformance"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// A contended wait's statements are prepared on its session; one whose session loses them between statements (here
// each is deallocated just before every EXECUTE of it, as something between the client and the server that resets
// sessions would) sends them as it is when the server says so, and prepares them again with the next: three waits
// in turn are still granted, once the holder lets go, and the last one's session holds the key (pg_locks).
func TestWaitPreparedLost(t *testing.T) {
	url := pgtest.URL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	holder, err := advlock.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	var lost atomic.Int64
	waiter, err := advlock.Open(ctx, url, conformance.WithWrap(func(c session.Conn) session.Conn { return losing{c, &lost} }))
	if err != nil {
		t.Fatal(err)
	}
	defer waiter.Close()
	key := conformance.Key(t)
	obs := pgtest.Conn(t, url)
	var l *advlock.Lock
	for range 3 { // each kind of statement sent again on the connection that prepared it
		if l != nil {
			if err := l.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
		}
		held, err := holder.Lock(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan *advlock.Lock, 1)
		go func() {
			l, err := waiter.Lock(ctx, key)
			if err != nil {
				t.Errorf("the wait: %v", err)
			}
			got <- l
		}()
		waiting(t, ctx, obs, key) // the wait is in the server's queue (it joined the line, prepared or not)
		if err := held.Unlock(ctx); err != nil {
			t.Fatal(err)
		}
		if l = <-got; l == nil {
			return
		}
	}
	defer l.Unlock(ctx)
	if lost.Load() < 2 {
		t.Fatalf("%d prepared statements lost: the waits sent none again", lost.Load())
	}
	var n int
	v, _ := key.Int64()
	if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock' AND objsubid = 1 AND ((classid::int8 << 32) | objid::int8) = $1 AND pid <> pg_backend_pid()", v).Scan(&n); err != nil || n != 1 {
		t.Fatalf("sessions holding the key: %d %v, want 1", n, err)
	}
}

// losing deallocates each statement advlock prepared just before it is executed.
type losing struct {
	session.Conn
	lost *atomic.Int64
}

func (c losing) QueryInt(ctx context.Context, sql string, args ...any) (int64, error) {
	if _, rest, ok := strings.Cut(sql, "EXECUTE advlock_"); ok {
		name, _, _ := strings.Cut(rest, "(")
		if _, err := c.Conn.QueryInt(ctx, "DEALLOCATE advlock_"+name+"; SELECT 1"); err == nil {
			c.lost.Add(1)
		}
	}
	return c.Conn.QueryInt(ctx, sql, args...)
}

// waiting waits until a session waits for key (pg_locks), and fails the test after 10 s.
func waiting(t *testing.T, ctx context.Context, obs *pgx.Conn, key advlock.Key) {
	t.Helper()
	v, _ := key.Int64()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1 AND ((classid::int8 << 32) | objid::int8) = $1", v).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("nobody waits for the key")
		}
	}
}
