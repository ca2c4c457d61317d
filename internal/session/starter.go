package session

import (
	"sync"
	"time"
)

// WatchDelay is about how long after the grant a lock's watcher starts reading its connection: between half of
// it and twice it.
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
	s.granted = time.Now()
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

// flush starts a watcher for every session queued for at least half of WatchDelay (so that a lock released a
// moment after the timer fires does not pay for a goroutine) and re-arms for the rest: a watcher starts between
// WatchDelay/2 and 2*WatchDelay after the grant.
func (st *Starter) flush() {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.armed = false
	now := time.Now()
	kept := st.pending[:0]
	for _, s := range st.pending {
		if now.Sub(s.granted) < WatchDelay/2 {
			s.pendingIdx = len(kept)
			kept = append(kept, s)
			continue
		}
		s.pendingIdx = -1
		go s.watch()
	}
	clear(st.pending[len(kept):])
	st.pending = kept
	if len(kept) > 0 {
		st.armed = true
		time.AfterFunc(WatchDelay, st.flush)
	}
}
