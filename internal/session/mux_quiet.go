package session

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
)

// onTimeout handles a read deadline: a silent idle session gets a keepalive round trip, a round trip unanswered
// past the bound ends the session.
func (m *Mux) onTimeout() error {
	if h := testHookSettle.Load(); h != nil {
		(*h)(m, "timeout")
	}
	m.mu.Lock()
	if m.dead != nil {
		// kill closed the socket while this reader held it (its deadline may have fired first): the reader is the one
		// to settle the Mux, never to hand a dead socket over.
		cause := m.dead
		m.mu.Unlock()
		return cause
	}
	if m.busy {
		left := m.bound - time.Since(m.sentAt)
		m.mu.Unlock()
		if left > 0 {
			_ = m.nc.SetReadDeadline(time.Now().Add(left))
			return nil
		}
		// The Mux closes its socket on this error: the session is gone, as after a network loss.
		return SessionEnded(fmt.Errorf("keepalive: no answer within %v", m.bound))
	}
	m.busy, m.wire, m.results, m.sentAt = true, nil, m.results[:0], time.Now()
	m.mu.Unlock()
	buf, _ := (&pgproto3.Sync{}).Encode(nil) // a keepalive: the server answers ReadyForQuery
	_ = m.nc.SetReadDeadline(time.Now().Add(m.bound))
	if _, err := m.nc.Write(buf); err != nil {
		return fmt.Errorf("keepalive: %w", err)
	}
	return nil
}

// armLocked schedules the background reader for when the socket has been quiet for WatchDelay.
func (m *Mux) armLocked() {
	if m.dead != nil {
		return
	}
	if m.timer == nil {
		m.timer = time.AfterFunc(WatchDelay, m.startBG)
		return
	}
	m.timer.Reset(WatchDelay)
}

// startBG starts the background reader if the socket is still free and quiet.
func (m *Mux) startBG() {
	m.mu.Lock()
	if m.dead != nil || m.busy || m.token != tokenFree {
		m.mu.Unlock()
		return
	}
	m.token = tokenBG
	m.bg.Add(1)
	// Under the lock, before any caller's round trip (which sets its own deadline as it goes out) can follow.
	_ = m.nc.SetReadDeadline(time.Now().Add(m.bound))
	m.mu.Unlock()
	if h := testHookReaderStarting.Load(); h != nil {
		(*h)(func() bool { m.mu.Lock(); defer m.mu.Unlock(); return m.handBack })
	}
	go func() {
		defer m.bg.Done()
		m.read(nil)
	}()
}

var testHookReaderStarting atomic.Pointer[func(asked func() bool)]

// testHookSettle, in tests only, is called by a reader as it handles a read deadline ("timeout") and as it
// settles an answered round trip ("complete"), before it takes the Mux's lock: the moments where a kill from
// another goroutine must still be settled by someone; and as a round trip is sent ("send"), before it is written.
var testHookSettle atomic.Pointer[func(m *Mux, at string)]

// testHookMessage, in tests only, sees every message a reader receives and may put another in its place: a fault
// on the wire, such as an error after a round trip's last row.
var testHookMessage atomic.Pointer[func(m *Mux, msg pgproto3.BackendMessage) pgproto3.BackendMessage]

// SetTestHookReaderStarting makes every background reader that starts on a quiet socket call f first, outside the
// Mux's lock; asked reports whether a caller's round trip went out for this reader to answer (and then give the
// socket up). nil removes it. Tests only.
func SetTestHookReaderStarting(f func(asked func() bool)) {
	if f == nil {
		testHookReaderStarting.Store(nil)
		return
	}
	testHookReaderStarting.Store(&f)
}
