package advsql_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/advsql"
	"github.com/advlock/advlock/internal/testkit/conformance"
	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// The Inspect, Leader and LockTable of a Locker over database/sql read through its *sql.DB, with either driver (New
// and Open), and see what the package functions see through a pgx connection: a shared holder and a waiter blocked
// by it (the int4[] of blockers read through database/sql), an exclusive holder as leader, the lock table's use.
func TestInspect(t *testing.T) {
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	for _, driver := range []string{"pgx", "postgres"} {
		for _, how := range []string{"New", "Open"} {
			t.Run(driver+"/"+how, func(t *testing.T) {
				ctx := ctxT(t, 30*time.Second)
				var l *advlock.Locker
				if how == "New" {
					l = advsql.New(openDB(t, driver, url))
				} else {
					var err error
					if l, err = advsql.Open(ctx, driver, url); err != nil {
						t.Fatal(err)
					}
				}
				defer l.Close()
				waiter := advsql.New(openDB(t, driver, url))
				defer waiter.Close()
				k := conformance.Key(t)
				lk, err := l.RLock(ctx, k)
				if err != nil {
					t.Fatal(err)
				}
				got := make(chan error, 1)
				go func() {
					w, err := waiter.Lock(ctx, k)
					if err == nil {
						err = w.Unlock(ctx)
					}
					got <- err
				}()
				var mine []advlock.LockInfo
				for deadline := time.Now().Add(10 * time.Second); len(mine) < 2; time.Sleep(5 * time.Millisecond) {
					mine = rowsOf(t, l.Inspect, ctx, k)
					if time.Now().After(deadline) {
						t.Fatalf("Locker.Inspect: want a holder and a waiter, got %+v", mine)
					}
				}
				h, w := mine[0], mine[1]
				if !h.Granted || !h.Shared || len(h.BlockedBy) != 0 || h.WaitStart != nil || h.BackendStart.IsZero() ||
					w.Granted || !slices.Equal(w.BlockedBy, []int32{h.PID}) || w.WaitStart == nil || w.State != "active" {
					t.Errorf("Locker.Inspect: holder %+v, waiter %+v", h, w)
				}
				if how == "Open" && h.ApplicationName != "advlock" {
					t.Errorf("the holder's application_name = %q, want advlock", h.ApplicationName)
				}
				v, _ := k.Int64()
				if pids, err := pgtest.Holders(ctx, obs, v); err != nil || len(pids) != 1 || int32(pids[0]) != h.PID {
					t.Errorf("pg_locks shows holders %v (%v), Locker.Inspect %d", pids, err, h.PID)
				}
				theirs := rowsOf(t, func(ctx context.Context) ([]advlock.LockInfo, error) { return advlock.Inspect(ctx, obs) }, ctx, k)
				sameRows(t, mine, theirs)

				use, err := l.LockTable(ctx)
				if err != nil || use.Advisory < 2 || use.Capacity < 64*100 {
					t.Errorf("Locker.LockTable = %+v, %v; want at least this test's 2 advisory locks", use, err)
				}
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
				if err := <-got; err != nil {
					t.Fatal(err)
				}

				led := conformance.Key(t)
				if _, ok, err := l.Leader(ctx, led); ok || err != nil {
					t.Errorf("Locker.Leader of a free key: %v, %v", ok, err)
				}
				lk, err = l.Lock(ctx, led)
				if err != nil {
					t.Fatal(err)
				}
				who, ok, err := l.Leader(ctx, led)
				lv, _ := led.Int64()
				pids, perr := pgtest.Holders(ctx, obs, lv)
				if err != nil || !ok || perr != nil || len(pids) != 1 || int32(pids[0]) != who.PID || !who.Key.Equal(led) ||
					who.Observed.IsZero() {
					t.Errorf("Locker.Leader = %+v, %v, %v; pg_locks shows %v (%v)", who, ok, err, pids, perr)
				}
				if err := lk.Unlock(ctx); err != nil {
					t.Fatal(err)
				}
				l.Close()
				if _, err := l.Inspect(ctx); !errors.Is(err, advlock.ErrClosed) {
					t.Errorf("Inspect after Close: %v, want ErrClosed", err)
				}
			})
		}
	}
}

// rowsOf returns the rows of k that inspect reports.
func rowsOf(t *testing.T, inspect func(context.Context) ([]advlock.LockInfo, error), ctx context.Context, k advlock.Key) []advlock.LockInfo {
	t.Helper()
	rows, err := inspect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []advlock.LockInfo
	for _, r := range rows {
		if r.Key.Equal(k) {
			out = append(out, r)
		}
	}
	return out
}

// sameRows compares two reads of the same locks, field by field (times with Equal: drivers differ in location).
func sameRows(t *testing.T, a, b []advlock.LockInfo) {
	t.Helper()
	if len(a) != len(b) {
		t.Fatalf("%d rows, and %d through a pgx connection", len(a), len(b))
	}
	for i := range a {
		x, y := a[i], b[i]
		sameWait := x.WaitStart == nil && y.WaitStart == nil || x.WaitStart != nil && y.WaitStart != nil && x.WaitStart.Equal(*y.WaitStart)
		if !x.Key.Equal(y.Key) || x.Shared != y.Shared || x.Granted != y.Granted || !sameWait ||
			!slices.Equal(x.BlockedBy, y.BlockedBy) || x.PID != y.PID || x.ApplicationName != y.ApplicationName ||
			x.ClientAddr != y.ClientAddr || !x.BackendStart.Equal(y.BackendStart) || x.State != y.State {
			t.Errorf("row %d: %+v, and through a pgx connection %+v", i, x, y)
		}
	}
}
