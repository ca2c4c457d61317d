package session

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Shared is the set of shared sessions of one Locker: at most Max, and at most half of the pool's connections,
// opened as they are needed. A request goes to a
// session with no round trip on the wire if there is one; when every open one is busy and fewer than Max are
// open, another is opened in the background while the request queues on the least loaded one (so nobody waits
// for a connection to be made, except for the first session).
//
// Every open runs in the background under a bound of its own (VerifyBound for all of it: the connection, its
// checks and settings, the prepared statements), whatever the context of the call that needed it, and Stop ends
// it at once. Callers that need a session while none is open wait for the open (or their context, or Stop).
type Shared struct {
	max             int
	pool            Pool
	cfg             Config
	frozenKeepalive time.Duration // the Locker's keepalive (cfg.Keepalive is the round-trip bound)

	mu      sync.Mutex
	muxes   []*Mux
	opening int
	openErr error // why the last open failed (nil once one succeeds)
	noWire  bool  // an open found that the driver cannot give its connection (ErrNoWire): none is opened again
	closed  bool
	bg      sync.WaitGroup
	bgCtx   context.Context
	bgStop  context.CancelFunc
	changed chan struct{} // closed (and replaced) whenever an open ends, and by Stop
}

// NewShared returns a set of at most max shared sessions over pool. keepalive is the Locker's: shared sessions
// silent for FrozenAfter(keepalive) are ended by the server.
func NewShared(max int, pool Pool, cfg Config, keepalive time.Duration) *Shared {
	s := &Shared{max: max, pool: pool, cfg: cfg, frozenKeepalive: keepalive, changed: make(chan struct{})}
	s.bgCtx, s.bgStop = context.WithCancel(context.Background())
	return s
}

// Get returns the shared session a request should go to: one with no round trip on the wire if there is one; else
// the least loaded (and, below the maximum, another opens in the background). With none open it waits for one to
// open, until ctx ends; a try (wait false) does not wait for a connection for it (ErrPoolExhausted), and neither
// does a wait, which takes a session of its own instead (so it waits for a connection as long as ctx allows).
// When the open it waited for failed, Get returns why.
func (s *Shared) Get(ctx context.Context, wait bool) (*Mux, error) {
	s.mu.Lock()
	waited := false
	for {
		if s.closed {
			s.mu.Unlock()
			return nil, ErrClosed
		}
		var best *Mux
		bestLoad, live := 0, 0
		for _, m := range s.muxes {
			busy, load, dead := m.state()
			if dead {
				continue // being removed
			}
			live++
			if !busy {
				s.mu.Unlock()
				return m, nil
			}
			if best == nil || load < bestLoad {
				best, bestLoad = m, load
			}
		}
		limit := s.limit()
		if limit == 0 && best == nil && s.opening == 0 {
			s.mu.Unlock()
			return nil, ErrNoShared
		}
		grow := live+s.opening < limit
		if best != nil {
			if grow {
				s.openLocked()
			}
			s.mu.Unlock()
			return best, nil
		}
		if waited && s.openErr != nil { // an open this call waited for failed: say why (never start another)
			err := s.openErr
			s.mu.Unlock()
			return nil, WithContext(ctx, err)
		}
		if grow {
			if s.pool.Stats().Exhausted() {
				s.mu.Unlock()
				return nil, ErrPoolExhausted
			}
			if s.opening == 0 { // one open at a time while none is open: the callers wait for it together
				s.openLocked()
			}
		}
		ch := s.changed // wait for an open to end
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, WithContext(ctx, errors.New("waiting for a shared session to open"))
		}
		waited = true
		s.mu.Lock()
	}
}

// limit is how many shared sessions may be open: Max, and at most half of the pool's connections, so that shared
// sessions, pinned for the Locker's life, never take every connection of a small pool that the application and
// the waits in the server share (a pool of 2: 1 shared session; a pool of 1: none, every lock takes a session of
// its own for as long as it is held). It is looked at when a session would open: sessions already open stay when
// the pool shrinks later.
func (s *Shared) limit() int {
	if s.noWire {
		return 0
	}
	if pm := s.pool.Stats().Max; pm > 0 {
		return min(s.max, pm/2)
	}
	return s.max
}

// ErrNoShared is what Get returns when the pool is too small for any shared session (see limit), or its driver
// cannot give its connection (ErrNoWire): the caller takes a session of its own.
var ErrNoShared = errors.New("advlock: the pool is too small for a shared session")

// ErrNoWire is what a Conn's Wire returns (wrapped) when the driver cannot give its connection for a shared session:
// the Shared then opens none (ErrNoShared), and every lock takes a session of its own.
var ErrNoWire = errors.New("advlock: the driver gives no access to its connection")

// openLocked starts opening one more shared session in the background.
func (s *Shared) openLocked() {
	s.opening++
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		bound := s.cfg.OpenBound
		if bound <= 0 {
			bound = VerifyBound
		}
		ctx, cancel := context.WithTimeout(s.bgCtx, bound)
		defer cancel()
		m, err := s.open(ctx)
		if err != nil && s.bgCtx.Err() == nil && ctx.Err() != nil {
			err = fmt.Errorf("open a shared session: not done within %v (%v)", bound, err)
		}
		s.mu.Lock()
		s.opening--
		s.openErr = err
		if errors.Is(err, ErrNoWire) {
			s.noWire = true // the driver cannot give its connection: every lock takes a session of its own
		}
		if err == nil {
			if s.closed {
				s.mu.Unlock()
				m.Close()
				return
			}
			s.muxes = append(s.muxes, m)
		}
		close(s.changed)
		s.changed = make(chan struct{})
		s.mu.Unlock()
	}()
}

// open makes one shared session.
func (s *Shared) open(ctx context.Context) (*Mux, error) {
	conn, err := s.cfg.Waits.acquire(ctx, s.pool) // Close ends the wait for a connection
	if err != nil {
		if errors.Is(err, ErrClosed) {
			return nil, err
		}
		return nil, fmt.Errorf("acquire connection: %w", err)
	}
	if s.cfg.Wrap != nil {
		conn = s.cfg.Wrap(conn)
	}
	conn = observe(conn, s.cfg.Events, "shared")
	if err := verify(ctx, s.pool, conn, s.cfg.Settings); err != nil {
		if errors.Is(err, ErrTxPooling) || errors.Is(err, ErrUnverified) {
			conn.Release()
		} else {
			becauseErr(conn, "checking a new connection failed", err)
			conn.Destroy()
		}
		return nil, err
	}
	// A shared session is advlock's for its whole life (destroyed, never pooled, at the end): a frozen holder's is
	// ended by the server (see FrozenAfter), whatever the pool's settings.
	if _, err := conn.QueryInt(ctx, frozenSQL(s.frozenKeepalive)); err != nil {
		becauseErr(conn, "setting up a shared session failed", err)
		conn.Destroy()
		return nil, fmt.Errorf("set up shared session: %w", err)
	}
	return OpenMux(ctx, conn, s.cfg.Keepalive, s.remove, s.cfg.UnlockKey, s.cfg.Fencing)
}

// remove drops a dead session from the set; later requests go to the others, or to a new one.
func (s *Shared) remove(m *Mux) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, x := range s.muxes {
		if x == m {
			s.muxes = append(s.muxes[:i], s.muxes[i+1:]...)
			return
		}
	}
}

// Unusable reports whether no shared session will ever open: the driver cannot give its connection (ErrNoWire).
func (s *Shared) Unusable() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.noWire
}

// Sessions is the number of shared sessions open now.
func (s *Shared) Sessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.muxes)
}

// Stop refuses later requests (ErrClosed), ends the opens under way and wakes the callers waiting for them. The
// sessions already open stay, for the unlocks that Close still makes.
func (s *Shared) Stop() {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.changed)
		s.changed = make(chan struct{})
	}
	s.mu.Unlock()
	s.bgStop()
}

// Close stops (see Stop), waits for the opens under way to end, and closes every shared session (locks still on
// them are reported ErrClosed).
func (s *Shared) Close() {
	s.Stop()
	s.bg.Wait()
	s.mu.Lock()
	muxes := append([]*Mux(nil), s.muxes...)
	s.mu.Unlock()
	for _, m := range muxes {
		m.Close()
	}
}
