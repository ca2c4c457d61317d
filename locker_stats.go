package advlock

import (
	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
)

// Stats is what a Locker is doing now.
type Stats struct {
	Held             int   // locks held
	HeldShared       int   // of them on shared sessions
	HeldLeases       int   // of them leases (WithLeases), which hold no session
	WaitingInProcess int   // Lock calls waiting behind another holder of the same key in this Locker
	WaitingInServer  int   // Lock calls waiting in PostgreSQL, each on a session of its own
	SharedSessions   int   // shared sessions open
	OwnSessions      int   // sessions of their own in use: holding a lock, or waiting in the server
	Campaigning      int   // Lead calls running (campaigning or leading)
	Leading          int   // of them, those leading now (their fn runs)
	CampaignRetries  int64 // Lead campaigns that failed for a passing reason and were tried again, since New or Open
	// Deadlock detection, since New or Open: readings of the server's lock graph (about one a second while a wait
	// whose caller holds a lock waits; none otherwise), and waits this Locker ended with ErrDeadlock.
	GraphReadings int64
	Deadlocks     int64
	// The connections this Locker takes from the server. Conns is how many it has now: its shared sessions, its
	// sessions of their own, DoTx's transactions, and those it takes for a moment (deadlock detection's readings,
	// Ping, Inspect, Leader, LockTable, the checks of a new connection); PeakConns is the most at once since New or
	// Open. With Open (and advsql.Open) the pool is the Locker's alone and Pool.Max is its budget; Conns exceeds it
	// by one only while deadlock detection reads on a connection it dialed outside the pool because none of the
	// pool's was free (the one kept for reads taken by a concurrent Inspect, Ping or DoTx), kept until no watched
	// wait waits. With New the application's queries share Pool.Max.
	Conns     int
	PeakConns int
	// MaxOwnSessions is how many sessions of their own (Lock calls waiting in the server, and the locks they got)
	// a Locker from Open (or advsql.Open) has at most at once: its pool's connections less the shared sessions and
	// one kept for its own reads (see [DefaultOpenConns]); with New over a limited pool, half of what the shared
	// sessions leave (see [New]); 0 where the pool is the only limit.
	// WaitingForSession counts the Lock calls waiting in this process because all of those are in use: they get
	// the sessions given back in the order they came, and meanwhile try their key again on a shared session
	// every 20 ms (less often when many wait). With New, waits that find the pool empty wait in the pool's own
	// queue instead.
	MaxOwnSessions    int
	WaitingForSession int
	// WaitYields counts, since Open, the waits in the server that gave their session of their own to a wait
	// queued for one (each after a whole slice without a grant), then queued again: with more waits than
	// MaxOwnSessions, each gets its turn in the server, one slice at a time.
	WaitYields int64
	Pool       PoolStats
}

// PoolStats are the figures of the pool a Locker takes sessions from (pgxpool, or database/sql's pool).
type PoolStats struct {
	Max       int   // the most connections it opens (0: no limit)
	Open      int   // connections open
	InUse     int   // taken out of the pool (by locks, shared sessions, waits, or the application)
	Idle      int   // open and free
	WaitCount int64 // acquisitions so far that had to wait for a connection
}

// Exhausted reports whether every connection the pool may open is taken: an acquisition now would wait.
func (p PoolStats) Exhausted() bool { return session.PoolStats(p).Exhausted() }

// Stats reports what the Locker holds and waits for, its sessions, and its pool's own figures. It takes the
// Locker's lock for a moment and reads the pool's counters; it sends nothing to the server.
func (l *Locker) Stats() Stats {
	var st Stats
	if l == nil || l.pool == nil {
		return st
	}
	l.mu.Lock()
	st.Held = len(l.held)
	for lk := range l.held {
		switch lk.h.(type) {
		case *session.Held:
			st.HeldShared++
		case *lease.Lease:
			st.HeldLeases++
		}
	}
	for _, g := range l.gates {
		st.WaitingInProcess += g.queue.Len()
	}
	l.mu.Unlock()
	st.WaitingInServer = l.cfg.Waits.Count()
	if l.shared != nil {
		st.SharedSessions = l.shared.Sessions()
	}
	st.OwnSessions = st.Held - st.HeldShared - st.HeldLeases + st.WaitingInServer
	st.Campaigning, st.Leading = int(l.campaigning.Load()), int(l.leading.Load())
	st.CampaignRetries = l.campaignRetries.Load()
	st.GraphReadings, st.Deadlocks = l.graphReadings.Load(), l.deadlocks.Load()
	st.Conns, st.PeakConns = int(l.connsNow.Load()), int(l.connsPeak.Load())
	if l.slots != nil {
		st.MaxOwnSessions = l.slots.max
		st.WaitingForSession = int(l.waitingSlot.Load())
		st.WaitYields = l.yields.Load()
	}
	st.Pool = PoolStats(l.pool.Stats())
	return st
}
