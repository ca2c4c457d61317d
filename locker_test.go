package advlock

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
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

	// A database that is down: Open does not connect and succeeds; Ping and the lock calls fail.
	down, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	dl, err := Open(down, "postgres://postgres@127.0.0.1:1/test?connect_timeout=2")
	if err != nil {
		t.Fatalf("Open of a database that is down: %v, want a Locker", err)
	}
	if err := dl.Ping(down); err == nil {
		t.Error("Ping of a database that is down succeeded")
	}
	if _, err := dl.TryLock(down, key(t)); err == nil {
		t.Error("TryLock on a database that is down succeeded")
	}
	dl.Close()

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

// fnError is an error type of fn's own, for errors.As.
type fnError struct{ err error }

func (e *fnError) Error() string { return "fn gave up: " + e.err.Error() }
func (e *fnError) Unwrap() error { return e.err }

// When the loss of the lock (its backend terminated) cancels fn's context, Do and TryDo return an error that
// matches ErrLockLost and not context.Canceled, whatever fn returned, with fn's error still reachable and shown;
// when the caller's ctx is cancelled instead, the result matches context.Canceled and not ErrLockLost. Do used to
// return "context canceled; and ... lock lost", which matched context.Canceled: a loss read as a client gone.
func TestDoLost(t *testing.T) {
	errFn := errors.New("fn's sentinel")
	returns := map[string]func(ctx context.Context) error{
		"ctx.Err()":     func(ctx context.Context) error { return ctx.Err() },
		"wrapped":       func(ctx context.Context) error { return fmt.Errorf("%w: %w", errFn, ctx.Err()) },
		"its own type":  func(ctx context.Context) error { return &fnError{ctx.Err()} },
		"the cause":     func(ctx context.Context) error { return context.Cause(ctx) },
		"nil":           func(context.Context) error { return nil },
		"its own error": func(context.Context) error { return errFn },
	}
	for _, shared := range []int{4, 0} {
		b := setup(t, WithSharedSessions(shared))
		for name, ret := range returns {
			for _, try := range []bool{false, true} {
				t.Run(fmt.Sprintf("shared %d/%s/try %v", shared, name, try), func(t *testing.T) {
					ctx := ctxT(t, 20*time.Second)
					k := key(t)
					fn := func(fctx context.Context) error {
						pgtest.Terminate(t, b.obs, b.holders(t, k)[0])
						select {
						case <-fctx.Done():
						case <-time.After(10 * time.Second):
							t.Error("fn's context not cancelled by the loss")
						}
						return ret(fctx)
					}
					var err error
					if try {
						err = b.l.TryDo(ctx, k, fn)
					} else {
						err = b.l.Do(ctx, k, fn)
					}
					t.Logf("%v", err)
					if !errors.Is(err, ErrLockLost) {
						t.Errorf("Do after a loss: %v, want ErrLockLost", err)
					}
					if errors.Is(err, context.Canceled) {
						t.Errorf("Do after a loss matches context.Canceled: %v", err)
					}
					if ctx.Err() != nil {
						t.Fatal(ctx.Err())
					}
					switch name {
					case "wrapped", "its own error":
						if !errors.Is(err, errFn) || !strings.Contains(err.Error(), errFn.Error()) {
							t.Errorf("fn's error not reachable or not shown: %v", err)
						}
					case "its own type":
						var fe *fnError
						if !errors.As(err, &fe) || !strings.Contains(err.Error(), "fn gave up: context canceled") {
							t.Errorf("fn's error not reachable or not shown: %v", err)
						}
					case "ctx.Err()":
						if !strings.Contains(err.Error(), "context canceled") {
							t.Errorf("fn's error not shown: %v", err)
						}
					}
					if code := errCode(err); code != "" && code != "57P01" {
						t.Errorf("the server's error in %v is %s, want the termination's 57P01", err, code)
					}
					b.waitFree(t, k)
				})
			}
		}
	}

	// The caller's ctx cancelled, the lock never lost: the result is the caller's cancellation.
	b := setup(t)
	k := key(t)
	ctx, cancel := context.WithCancel(ctxT(t, 20*time.Second))
	err := b.l.Do(ctx, k, func(fctx context.Context) error {
		cancel()
		<-fctx.Done()
		return fctx.Err()
	})
	if !errors.Is(err, context.Canceled) || errors.Is(err, ErrLockLost) {
		t.Errorf("Do whose caller's ctx was cancelled: %v, want context.Canceled and not ErrLockLost", err)
	}
	if pids := b.holders(t, k); len(pids) != 0 {
		t.Errorf("after Do, pg_locks shows %v", pids)
	}
}

// errCode returns the SQLSTATE of the server error inside err.
func errCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// Callers of one Locker that wait for a key in-process get it in the order they came, exclusive and shared alike
// (a run of shared callers together): with every caller woken to race for the slot, some waited for ever while
// others took it again and again (256 goroutines on one key: 83x between the luckiest and the unluckiest).
func TestGateFIFO(t *testing.T) {
	b := setup(t)
	ctx := ctxT(t, 30*time.Second)
	k := key(t)
	first, err := b.l.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	modes := []bool{false, false, true, true, false, true} // shared?
	var mu sync.Mutex
	var order []int
	var wg sync.WaitGroup
	for i, shared := range modes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lock := b.l.Lock
			if shared {
				lock = b.l.RLock
			}
			lk, err := lock(ctx, k)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			time.Sleep(20 * time.Millisecond)
			if err := lk.Unlock(ctx); err != nil {
				t.Error(err)
			}
		}()
		for b.l.Stats().WaitingInProcess != i+1 { // queued before the next one comes
			time.Sleep(time.Millisecond)
		}
	}
	if _, err := b.l.TryRLock(ctx, k); !errors.Is(err, ErrNotAcquired) {
		t.Errorf("a try while others queue: %v, want ErrNotAcquired", err)
	}
	if err := first.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	// 0 and 1 one after the other, then 2 and 3 together (either order), then 4, then 5.
	if len(order) != len(modes) || order[0] != 0 || order[1] != 1 || order[2]+order[3] != 5 || order[4] != 4 || order[5] != 5 {
		t.Errorf("granted in the order %v, want 0 1 {2 3} 4 5", order)
	}
	if st := b.l.Stats(); st.WaitingInProcess != 0 || st.Held != 0 {
		t.Errorf("after: %+v", st)
	}
}
