package session

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Waits tracks what of one Locker may wait — calls waiting for a connection from the pool, and lock statements
// waiting in the server — so that Close can end them: the first have their context cancelled, the second their
// sockets closed (instead of threading a cancellable context through every statement, which costs each Lock a
// context and the driver's context watcher). The zero value is ready to use; a nil *Waits tracks nothing.
type Waits struct {
	mu        sync.Mutex
	conns     map[Conn]struct{}
	acquiring map[uint64]context.CancelCauseFunc
	next      uint64
	closed    bool
	apart     sync.WaitGroup // set-ups going on after their callers left (see setUp)
}

// acquire takes a connection from pool; Close makes it fail with ErrClosed. From a pool that makes a new connection
// in the caller's context (DialsInCall) with room for one, the taking goes on when ctx ends (see setUp), and a
// connection made after the call has returned goes back to the pool.
func (w *Waits) acquire(ctx context.Context, pool Pool) (Conn, error) {
	if w == nil {
		return pool.Acquire(ctx)
	}
	if err := ctx.Err(); err != nil {
		return nil, err // nothing begun
	}
	if pool.DialsInCall() && ctx.Done() != nil {
		// Only when a connection is to be made (none idle, room for one): an idle one is handed out at once, and a
		// wait for one given back is the caller's to make.
		if st := pool.Stats(); st.Idle == 0 && !st.Exhausted() {
			c, err, ran := w.setUp(ctx, pool.Acquire, Conn.Release)
			if !ran {
				return nil, ErrClosed
			}
			return c, err
		}
	}
	actx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil, ErrClosed
	}
	if w.acquiring == nil {
		w.acquiring = map[uint64]context.CancelCauseFunc{}
	}
	id := w.next
	w.next++
	w.acquiring[id] = cancel
	w.mu.Unlock()
	c, err := pool.Acquire(actx)
	w.mu.Lock()
	delete(w.acquiring, id)
	w.mu.Unlock()
	if err != nil && ctx.Err() == nil && context.Cause(actx) == ErrClosed {
		return nil, ErrClosed
	}
	return c, err
}

// check verifies conn (see verify) within VerifyBound, and ends a connection that fails the checks (back to the
// pool when they merely could not prove it, destroyed otherwise). When ctx ends first, check returns its error at
// once and the checks go on apart (see setUp): a connection that passes them goes back to the pool checked, so
// that the next call need not make and check one again.
func (w *Waits) check(ctx context.Context, pool Pool, conn Conn, settings []Setting) error {
	if ok, _ := conn.Verified(); ok {
		return nil
	}
	run := func(ctx context.Context) (Conn, error) {
		vctx, cancel := context.WithTimeout(ctx, VerifyBound)
		err := verify(vctx, pool, conn, settings)
		boundPassed := ctx.Err() == nil && vctx.Err() != nil
		cancel()
		switch {
		case err == nil:
			return conn, nil
		case errors.Is(err, ErrTxPooling) || errors.Is(err, ErrUnverified):
			conn.Release() // no lock was taken
		default:
			if boundPassed {
				err = fmt.Errorf("check session: no answer within %v; session closed", VerifyBound)
			}
			becauseErr(conn, "checking a new connection failed", err)
			conn.Destroy()
		}
		return nil, err
	}
	if w == nil || ctx.Done() == nil {
		_, err := run(ctx)
		return err
	}
	_, err, ran := w.setUp(ctx, run, Conn.Release)
	if !ran {
		conn.Release() // nothing was sent
	}
	return err
}

// setUp runs set, which takes or checks a connection, and returns what it returns; ran is false when Close had
// already run (set did not run, the error is ErrClosed). When ctx ends first setUp returns ctx's error at once, and
// set goes on apart, under a context of its own that Close ends, and that ends ApartGrace after ctx does (a
// connection that is being made, or answering its checks, on a loaded server is seldom far from done; one that does
// not answer, in a network that drops packets, is then dropped soon after the call, not held; a driver that ignores
// its context while it connects, as lib/pq does without connect_timeout, is not cut by either); drop gets the
// connection that set gives after the call has returned. The error then says so (AfterSetUp), so that what the
// connection counts against, a session slot, is given back after it. Wait waits for set to end.
func (w *Waits) setUp(ctx context.Context, set func(context.Context) (Conn, error), drop func(Conn)) (c Conn, err error, ran bool) {
	sctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		cancel(nil)
		return nil, ErrClosed, false
	}
	if w.acquiring == nil {
		w.acquiring = map[uint64]context.CancelCauseFunc{}
	}
	id := w.next
	w.next++
	w.acquiring[id] = cancel
	w.apart.Add(1)
	w.mu.Unlock()
	type result struct {
		c   Conn
		err error
	}
	got := make(chan result) // unbuffered: a result is either taken by the caller or dropped, never both
	var late atomic.Pointer[time.Timer]
	left := &apartErr{}
	go func() {
		defer w.apart.Done()
		c, err := set(sctx)
		select {
		case got <- result{c, err}:
		case <-ctx.Done():
			if c != nil {
				drop(c)
			}
			left.end()
		}
		w.mu.Lock()
		delete(w.acquiring, id)
		w.mu.Unlock()
		cancel(nil)
		if t := late.Load(); t != nil {
			t.Stop()
		}
	}()
	select {
	case r := <-got:
		if r.err != nil && ctx.Err() == nil && context.Cause(sctx) == ErrClosed {
			return nil, ErrClosed, true
		}
		return r.c, r.err, true
	case <-ctx.Done():
		t := time.AfterFunc(ApartGrace, func() { cancel(context.DeadlineExceeded) })
		late.Store(t)
		if sctx.Err() != nil { // set has ended, and may not have seen the timer
			t.Stop()
		}
		left.err = WithContext(ctx, ctx.Err())
		return nil, left, true
	}
}

// ApartGrace is how long a connection's set-up goes on after the call that needed it has returned (see setUp).
const ApartGrace = time.Second

// apartErr is setUp's error for a call that left while its connection was still being set up.
type apartErr struct {
	err  error
	mu   sync.Mutex
	done bool
	then []func()
}

func (e *apartErr) Error() string { return e.err.Error() }
func (e *apartErr) Unwrap() error { return e.err }

// end runs what waited for the set-up's end.
func (e *apartErr) end() {
	e.mu.Lock()
	e.done = true
	then := e.then
	e.then = nil
	e.mu.Unlock()
	for _, f := range then {
		f()
	}
}

// AfterSetUp runs f once the connection that err's call left behind, still being set up (see Waits.setUp), is back
// in its pool or destroyed, and reports true; it reports false, running nothing, when err left none behind, or its
// set-up has ended already: the caller then runs f itself.
func AfterSetUp(err error, f func()) bool {
	var e *apartErr
	if !errors.As(err, &e) {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.done {
		return false
	}
	e.then = append(e.then, f)
	return true
}

// add registers conn for the duration of a wait; it returns false when Close already ran.
func (w *Waits) add(conn Conn) bool {
	if w == nil {
		return true
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return false
	}
	if w.conns == nil {
		w.conns = map[Conn]struct{}{}
	}
	w.conns[conn] = struct{}{}
	return true
}

// remove ends conn's registration, before the connection goes back to its pool or is destroyed (so that Close can
// never abort a connection someone else now uses). It returns false when Close ran meanwhile, which may have
// aborted the wait.
func (w *Waits) remove(conn Conn) bool {
	if w == nil {
		return true
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.conns, conn)
	return !w.closed
}

// Close aborts every registered wait, and the set-ups going on apart (see setUp), and refuses later ones. It
// reports nothing; the aborted calls return errors matching ErrClosed and close their sessions.
func (w *Waits) Close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
	for c := range w.conns {
		c.Abort()
	}
	for _, cancel := range w.acquiring {
		cancel(ErrClosed)
	}
}

// Wait waits for the set-ups going on apart (see setUp) to end; after Close, they end soon.
func (w *Waits) Wait() {
	if w != nil {
		w.apart.Wait()
	}
}

// Count is the number of lock statements waiting in the server now.
func (w *Waits) Count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.conns)
}
