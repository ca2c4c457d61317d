package session

import "sync"

// Waits tracks the connections of one Locker whose lock statements are waiting in the server, so that Close can
// abort them by closing their sockets instead of threading a cancellable context through every call (which costs
// each Lock a context and pgx's context watcher). The zero value is ready to use.
type Waits struct {
	mu     sync.Mutex
	conns  map[Conn]struct{}
	closed bool
}

// add registers conn for the duration of a wait; it returns false when Close already ran.
func (w *Waits) add(conn Conn) bool {
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

func (w *Waits) remove(conn Conn) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.conns, conn)
}

// Close aborts every registered wait and refuses later ones. It reports nothing; the aborted calls return errors
// and close their sessions.
func (w *Waits) Close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
	for c := range w.conns {
		c.Abort()
	}
}
