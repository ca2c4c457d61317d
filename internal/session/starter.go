package session

import (
	"sync"
	"time"
)

// WatchDelay is how long after the grant a lock's watcher starts reading its connection (at most twice this).
// A lock released sooner never needs the goroutine; a loss in that first moment is seen when it starts.
const WatchDelay = time.Millisecond

// Starter starts the watchers of the sessions of one Locker, in batches: one timer serves every lock taken within
// the same WatchDelay, instead of a timer per lock. The zero value is ready to use.
type Starter struct {
	mu      sync.Mutex
	pending []*Session // not yet watched; each knows its index
	armed   bool
}

// add queues s to be watched after WatchDelay.
func (st *Starter) add(s *Session) {
	st.mu.Lock()
	defer st.mu.Unlock()
	s.pendingIdx = len(st.pending)
	st.pending = append(st.pending, s)
	if !st.armed {
		st.armed = true
		time.AfterFunc(WatchDelay, st.flush)
	}
}

// remove takes s off the queue and reports whether it was still there (so its watcher never started).
func (st *Starter) remove(s *Session) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	i := s.pendingIdx
	if i < 0 {
		return false
	}
	last := len(st.pending) - 1
	st.pending[i] = st.pending[last]
	st.pending[i].pendingIdx = i
	st.pending[last] = nil
	st.pending = st.pending[:last]
	s.pendingIdx = -1
	return true
}

// flush starts a watcher for every queued session.
func (st *Starter) flush() {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.armed = false
	for i, s := range st.pending {
		s.pendingIdx = -1
		go s.watch()
		st.pending[i] = nil
	}
	st.pending = st.pending[:0]
}
