package session

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Shared is the set of shared sessions of one Locker: at most Max, opened as they are needed. A request goes to a
// session with no round trip on the wire if there is one; when every open one is busy and fewer than Max are
// open, another is opened in the background while the request queues on the least loaded one (so nobody waits
// for a connection to be made, except for the first session).
type Shared struct {
	max             int
	pool            Pool
	cfg             Config
	frozenKeepalive time.Duration // the Locker's keepalive (cfg.Keepalive is the round-trip bound)

	mu      sync.Mutex
	muxes   []*Mux
	opening int
	closed  bool
	bg      sync.WaitGroup
	bgCtx   context.Context
	bgStop  context.CancelFunc
	changed chan struct{} // closed (and replaced) whenever an open ends
}

// NewShared returns a set of at most max shared sessions over pool. keepalive is the Locker's: shared sessions
// silent for FrozenAfter(keepalive) are ended by the server.
func NewShared(max int, pool Pool, cfg Config, keepalive time.Duration) *Shared {
	s := &Shared{max: max, pool: pool, cfg: cfg, frozenKeepalive: keepalive, changed: make(chan struct{})}
	s.bgCtx, s.bgStop = context.WithCancel(context.Background())
	return s
}

// Get returns the shared session a request should go to: one with no round trip on the wire if there is one; else
// the least loaded (and, below the maximum, another opens in the background); with none open, a new one (a try,
// wait false, does not wait for a connection for it: ErrPoolExhausted); with every slot being opened, the first
// to open.
func (s *Shared) Get(ctx context.Context, wait bool) (*Mux, error) {
	s.mu.Lock()
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
		grow := live+s.opening < s.max
		switch {
		case best != nil:
			if grow {
				s.opening++
				s.bg.Add(1)
				go func() {
					defer s.bg.Done()
					ctx, cancel := context.WithTimeout(s.bgCtx, 30*time.Second)
					defer cancel()
					_, _ = s.open(ctx)
				}()
			}
			s.mu.Unlock()
			return best, nil
		case grow:
			if !wait && s.pool.Stats().Exhausted() {
				s.mu.Unlock()
				return nil, ErrPoolExhausted
			}
			s.opening++
			s.mu.Unlock()
			return s.open(ctx)
		}
		ch := s.changed // every slot is being opened: wait for one
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, WithContext(ctx, errors.New("waiting for a shared session to open"))
		}
		s.mu.Lock()
	}
}

// open makes one shared session and adds it to the set.
func (s *Shared) open(ctx context.Context) (m *Mux, err error) {
	defer func() {
		s.mu.Lock()
		s.opening--
		close(s.changed)
		s.changed = make(chan struct{})
		if err == nil {
			if s.closed {
				s.mu.Unlock()
				m.Close()
				m, err = nil, ErrClosed
				return
			}
			s.muxes = append(s.muxes, m)
		}
		s.mu.Unlock()
	}()
	conn, err := s.cfg.Waits.acquire(ctx, s.pool) // Close ends the wait for a connection
	if err != nil {
		if errors.Is(err, ErrClosed) {
			return nil, err
		}
		return nil, WithContext(ctx, fmt.Errorf("acquire connection: %w", err))
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
		return nil, WithContext(ctx, err)
	}
	// A shared session is advlock's for its whole life (destroyed, never pooled, at the end): a frozen holder's is
	// ended by the server (see FrozenAfter), whatever the pool's settings.
	if _, err := conn.QueryInt(ctx, frozenSQL(s.frozenKeepalive)); err != nil {
		becauseErr(conn, "setting up a shared session failed", err)
		conn.Destroy()
		return nil, WithContext(ctx, fmt.Errorf("set up shared session: %w", err))
	}
	m, err = OpenMux(ctx, conn, s.cfg.Keepalive, s.remove, s.cfg.UnlockKey, s.cfg.Fencing)
	if err != nil {
		return nil, WithContext(ctx, err)
	}
	return m, nil
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

// Sessions is the number of shared sessions open now.
func (s *Shared) Sessions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.muxes)
}

// Close closes every shared session (locks still on them are reported ErrClosed) and waits for background work.
func (s *Shared) Close() {
	s.mu.Lock()
	s.closed = true
	muxes := append([]*Mux(nil), s.muxes...)
	s.mu.Unlock()
	s.bgStop()
	s.bg.Wait()
	for _, m := range muxes {
		m.Close()
	}
}
