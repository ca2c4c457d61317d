package session

import (
	"context"
	"sync"
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
}

// acquire takes a connection from pool; Close makes it fail with ErrClosed.
func (w *Waits) acquire(ctx context.Context, pool Pool) (Conn, error) {
	if w == nil {
		return pool.Acquire(ctx)
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

// Close aborts every registered wait and refuses later ones. It reports nothing; the aborted calls return errors
// matching ErrClosed and close their sessions.
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

// Count is the number of lock statements waiting in the server now.
func (w *Waits) Count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.conns)
}
