package advlock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/pgtest"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestMisuse(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)

	if _, err := New(nil).Lock(ctx, key(t)); !errors.Is(err, ErrNoPool) {
		t.Errorf("New(nil).Lock: %v, want ErrNoPool", err)
	}
	New(nil).Close()
	var nilLocker *Locker
	if _, err := nilLocker.TryLock(ctx, key(t)); !errors.Is(err, ErrNoPool) {
		t.Errorf("nil Locker: %v, want ErrNoPool", err)
	}
	if _, err := b.l.Lock(ctx, Key{}); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("zero Key: %v, want ErrInvalidKey", err)
	}

	lk, err := b.l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); !errors.Is(err, ErrNotHeld) {
		t.Errorf("second Unlock: %v, want ErrNotHeld", err)
	}
	if !errors.Is(lk.Err(), ErrNotHeld) {
		t.Errorf("Err after Unlock: %v, want ErrNotHeld", lk.Err())
	}

	// Close releases what is held; later calls say ErrClosed.
	l := New(b.pool)
	held, err := l.TryLock(ctx, key(t))
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	l.Close()
	select {
	case <-held.Done():
	default:
		t.Error("Done not closed after Close")
	}
	if !errors.Is(held.Err(), ErrClosed) {
		t.Errorf("Err after Close: %v, want ErrClosed", held.Err())
	}
	if pids := b.holders(t, held.Key()); len(pids) != 0 {
		t.Errorf("Close left %s held by %v", held.Key(), pids)
	}
	if err := held.Unlock(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Unlock after Close: %v, want ErrClosed", err)
	}
	if _, err := l.Lock(ctx, key(t)); !errors.Is(err, ErrClosed) {
		t.Errorf("Lock after Close: %v, want ErrClosed", err)
	}
	if err := l.Do(ctx, key(t), func(context.Context) error { return nil }); !errors.Is(err, ErrClosed) {
		t.Errorf("Do after Close: %v, want ErrClosed", err)
	}

	// A database that is down: Open fails.
	down, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if l, err := Open(down, "postgres://postgres@127.0.0.1:1/test?connect_timeout=2"); err == nil {
		l.Close()
		t.Error("Open of a database that is down succeeded")
	}

	// A closed pool: an error, not a panic or a hang.
	p := pgtest.Pool(t, b.url, nil)
	p.Close()
	if _, err := New(p).TryLock(ctx, key(t)); err == nil {
		t.Error("TryLock on a closed pool succeeded")
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// A Lock whose ctx ends while it waits returns an error wrapping ctx.Err() and holds nothing.
func TestLockContextEnds(t *testing.T) {
	b := setup(t)
	k := key(t)
	holder, err := b.l.TryLock(ctxT(t, 10*time.Second), k)
	if err != nil {
		t.Fatal(err)
	}
	other := New(pgtest.Pool(t, b.url, nil))
	defer other.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err = other.Lock(ctx, k)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Lock past its deadline: %v, want DeadlineExceeded", err)
	}
	// in-process waiter too
	ctx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, err := b.l.Lock(ctx2, k); !errors.Is(err, context.Canceled) {
		t.Errorf("in-process wait with cancelled ctx: %v, want Canceled", err)
	}
	if err := holder.Unlock(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.waitFree(t, k)
}

// Do runs fn under the lock and unlocks after; it unlocks and re-panics when fn panics.
func TestDo(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 10*time.Second)
	k := key(t)
	var ran bool
	err := b.l.Do(ctx, k, func(ctx context.Context) error {
		ran = true
		if pids := b.holders(t, k); len(pids) != 1 {
			t.Errorf("inside Do, pg_locks shows %v", pids)
		}
		return nil
	})
	if err != nil || !ran {
		t.Fatalf("Do = %v, ran=%v", err, ran)
	}
	boom := errors.New("boom")
	if err := b.l.Do(ctx, k, func(context.Context) error { return boom }); !errors.Is(err, boom) {
		t.Errorf("Do returned %v, want fn's error", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "panic in fn" {
				t.Errorf("recovered %v, want the panic from fn", r)
			}
		}()
		_ = b.l.Do(ctx, k, func(context.Context) error { panic("panic in fn") })
	}()
	if pids := b.holders(t, k); len(pids) != 0 {
		t.Errorf("after Do, pg_locks shows %v", pids)
	}
	pgtest.NoIdleLocks(t, b.pool, b.obs)
}

// errCode returns the SQLSTATE of the server error inside err.
func errCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}
