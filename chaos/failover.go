package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/pgcluster"
	"github.com/advlock/advlock/internal/testkit/faults"
)

// A failover campaign (Options.Failover) runs the locks on a primary and a hot standby that streams from it
// through a fault proxy (repl), and the ledger on a server of its own. The workers' DSN names both servers, in a
// fixed order, with target_session_attrs=read-write: a new connection goes to whichever is the primary now. The
// fault "failover" is what a failover manager does after the primary is lost, with the commits the standby had
// not received lost with it:
//
//  1. the standby lags: its replication stream is held (a blackhole) for 0.5 to 2 s while the workers go on
//     taking locks and drawing fencing tokens on the primary (and the campaign draws 40 more as another client
//     would, so that the standby's copy of the sequence is surely behind);
//  2. the primary is stopped (immediate): every session on it ends, which is the fault's evidence for the checker
//     (as a restart's), and the WAL the standby never got is gone;
//  3. the standby is promoted (pg_ctl promote): a new timeline, the new primary;
//  4. the old primary is thrown away and rebuilt as the new primary's standby (a new base backup), streaming
//     through a new proxy; the campaign goes on, and the next failover goes the other way.
//
// The checker's token rules hold across it: a clean holder's token is greater than the token of every holder
// whose writes came before its own, and a clean holder's fenced writes are never refused. Tokens drawn on the
// lost primary that the standby never saw would come back lower on the promoted one without the timeline in the
// token; the resource (the ledger's fence) keeps the largest it accepted, so such holders would be refused.

// startFailover starts the standby (streaming through repl) and the ledger's own server.
func (c *campaign) startFailover() error {
	var err error
	if c.ledgerDB, err = pgcluster.Start("max_connections = 100"); err != nil {
		return err
	}
	s, repl, err := c.newStandby(c.cluster, nil)
	if err != nil {
		return err
	}
	c.standby, c.repl = s, repl
	c.servers = append(c.servers, s)
	return nil
}

// stopFailover removes the ledger's server and the replication proxy (the servers go with c.servers).
func (c *campaign) stopFailover() {
	c.srvMu.Lock()
	defer c.srvMu.Unlock()
	if c.repl != nil {
		c.repl.Close()
	}
	if c.ledgerDB != nil {
		c.ledgerDB.Remove()
	}
}

// newStandby makes a standby of p that streams through a new proxy: old, rebuilt (its data thrown away), or a
// new server when old is nil.
func (c *campaign) newStandby(p, old *pgcluster.Cluster) (*pgcluster.Cluster, *faults.Proxy, error) {
	repl, err := faults.New(fmt.Sprintf("127.0.0.1:%d", p.Port))
	if err != nil {
		return nil, nil, err
	}
	s := old
	if old == nil {
		s, err = p.StandbyVia("127.0.0.1", repl.Port())
	} else {
		err = old.RebuildAsStandbyOf(p, "127.0.0.1", repl.Port())
	}
	if err != nil {
		repl.Close()
		return nil, nil, err
	}
	return s, repl, nil
}

// multiHost is a DSN naming both servers (at addrs, else directly), in the order they were started, that
// connects to whichever accepts writes.
func (c *campaign) multiHost(addrs []string) string {
	if addrs == nil {
		for _, s := range c.servers {
			addrs = append(addrs, fmt.Sprintf("127.0.0.1:%d", s.Port))
		}
	}
	return fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=5",
		strings.Join(addrs, ","))
}

// failover makes the standby lag, stops the primary, promotes the standby, records the fault (from the stop to
// the promotion), and rebuilds the old primary as the new standby.
func (c *campaign) failover(ctx context.Context, rng *rand.Rand, f fault) {
	c.srvMu.Lock()
	p, s, repl := c.cluster, c.standby, c.repl
	c.srvMu.Unlock()
	if s == nil || repl == nil {
		c.logf("failover: no standby")
		return
	}
	lag := time.Duration(500+rng.IntN(1500)) * time.Millisecond
	repl.Blackhole(true)
	// Other clients of the cluster draw tokens too: 40 now, more than the 32 values a sequence logs ahead, so the
	// standby's copy of the sequence is behind what the primary has handed out, whatever the workers' pace; the
	// workers' grants during the lag then come after those.
	if _, err := c.execRows(ctx, `SELECT count(nextval('public.advlock_fence')) FROM generate_series(1, 40)`); err != nil {
		c.logf("failover: drawing tokens on the primary: %v", err)
	}
	sleepCtx(ctx, lag)
	f.At = time.Now()
	if err := p.Stop("immediate"); err != nil {
		c.logf("failover: %v", err)
		repl.Blackhole(false)
		return
	}
	f.Stopped = time.Now()
	repl.Cut()
	repl.Close()
	c.srvMu.Lock()
	c.standby, c.repl = nil, nil
	c.srvMu.Unlock()
	err := s.Promote()
	f.Until = time.Now()
	if err != nil {
		// The stop ended every session all the same: it is evidence. The campaign cannot go on without a primary:
		// the old one starts again, as an operator would, and the standby is thrown away and rebuilt from it (a
		// promotion that timed out may still finish: a second server accepting writes must not be left).
		f.Detail = fmt.Sprintf("the primary %d stopped; promoting the standby %d failed: %v", p.Port, s.Port, err)
		c.record(f)
		if err := p.Start(); err != nil {
			c.logf("failover: starting the old primary again: %v", err)
			return
		}
		c.rebuild(p, s)
		return
	}
	c.srvMu.Lock()
	c.cluster = s
	c.failovers++
	c.srvMu.Unlock()
	if c.bouncer != nil {
		if err := c.bouncer.Repoint(s.URL); err != nil {
			c.logf("failover: repointing PgBouncer at %d: %v", s.Port, err)
		}
	}
	f.Detail = fmt.Sprintf("the standby %d lagged %v, promoted %v after the primary %d stopped", s.Port,
		lag.Round(time.Millisecond), f.Until.Sub(f.At).Round(time.Millisecond), p.Port)
	c.record(f)
	if c.opt.Leases {
		start := time.Now()
		c.keepLostLeaseLog(ctx, p)
		c.logf("failover: read the lease log of %d in %v", p.Port, time.Since(start).Round(time.Millisecond))
	}
	c.rebuild(s, p)
}

// keepLostLeaseLog reads the lease log of p, the primary lost to a failover, before it is rebuilt: its holders
// were told of grants and renewals that the promoted server never received, and the checker judges them by what
// p had committed. p starts aside (see pgcluster.Cluster.Aside): no worker can reach it.
func (c *campaign) keepLostLeaseLog(ctx context.Context, p *pgcluster.Cluster) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second) // needed even if the run just ended
	defer cancel()
	err := p.Aside(func(url string) error {
		entries, err := readLeaseLog(ctx, url)
		if err == nil {
			c.srvMu.Lock()
			c.lostLeaseLog = append(c.lostLeaseLog, correctClock(entries)...)
			c.srvMu.Unlock()
		}
		return err
	})
	if err != nil {
		c.logf("failover: reading the lost primary's lease log: %v", err)
		c.srvMu.Lock()
		c.lostLogsUnread++
		c.srvMu.Unlock()
	}
}

// rebuild makes old (its data thrown away) the standby of p, streaming through a new proxy.
func (c *campaign) rebuild(p, old *pgcluster.Cluster) {
	start := time.Now()
	ns, nrepl, err := c.newStandby(p, old)
	if err != nil {
		c.logf("failover: rebuilding %d as the standby of %d: %v", old.Port, p.Port, err)
		return
	}
	c.srvMu.Lock()
	c.standby, c.repl = ns, nrepl
	c.srvMu.Unlock()
	c.logf("failover: %d streams from %d again (rebuilt in %v)", old.Port, p.Port, time.Since(start).Round(time.Millisecond))
}
