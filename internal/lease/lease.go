// Package lease holds locks as rows of a table instead of session locks: every statement is one short autocommit
// statement without parameters, which any pooler (in any mode) and any driver carries. A lease is a sibling of a
// held session lock (internal/session): the root package holds either through the same small handle (Done, Err,
// Release, AfterEnd, Token, PID). A Client takes and keeps the leases of one Locker.
//
//	grant (a conditional upsert: free, or a record seen unchanged for a lease length) -> renew every Config.Renew
//	(keyed on owner and term) -> release (a delete keyed on owner and term), or lost: taken over, broken, or not
//	renewed in time
//
// Which clock decides what. Only each process's own monotonic clock measures time:
//   - the holder trusts its lease until its monotonic clock, counted from the moment it sent the statement that
//     granted or last renewed it, reaches Length less Margin; Done closes then at the latest;
//   - a taker takes over a row only once it has seen the same record (term and expiry) for the holder's whole
//     length on its monotonic clock, counted from the answer that first showed it: the record was made after the
//     holder sent the statement that made it, so the holder has stopped trusting it by then;
//   - the server's clock only orders: it makes each record's expiry (later at every grant and renewal, whatever
//     the clock does), stamps the queue of waits, and bounds the moment a statement may still act (until: what the
//     client last learnt of it, so that a statement held back on its way grants nothing). A step of it makes a
//     statement refused early or undone later, never a second holder.
//
// The exception, the wait after a crash or a promotion (the server's clock measures it), is in restartCheck.
package lease

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// Config is what a Locker's leases are made of.
type Config struct {
	Length time.Duration // how long a grant or renewal lasts: what a taker waits, unchanged, before taking over
	Renew  time.Duration // how often a held lease is renewed
	Margin time.Duration // the holder stops trusting its lease this long before Length after its last send
	Poll   time.Duration // how often a waiting Lock tries again (with jitter)
	Bound  time.Duration // how long one statement may go unanswered (a grant also no longer than Length-Margin)
	Holder string        // who holds, for people (advlock ls)
	Sweep  time.Duration // how often the Client deletes what dead holders and waiters left (sweep.go); 0: never
}

// Defaults: a 15 s lease renewed every 5 s, so that two renewals in a row may fail (a database restarting, a
// network blip) before the holder stops trusting it, trust ending 1 s before the lease, and a dead holder's key
// free again about 15 s after its last renewal; waits try about 5 times a second.
func Defaults() Config {
	return Config{Length: 15 * time.Second, Renew: 5 * time.Second, Margin: time.Second, Poll: 200 * time.Millisecond,
		Bound: 5 * time.Second, Sweep: 5 * time.Second}
}

// Lease is one held lease.
type Lease struct {
	c     *Client
	id    session.ID
	owner string
	term  int64
	onEnd session.OnEnd

	end      session.End
	released atomic.Bool
	stopping atomic.Bool // its renewals are to stop (halt)
	stopOnce sync.Once
	started  atomic.Bool
	rs       renewState // its renewals' state, the Client's renewal loop's alone (renewer.go)
	addAt    int        // its place in the renewers' adds, -1 when not there (guarded by the renewers' mu)

	mu      sync.Mutex
	ended   bool          // its renewals have ended (started leases only): see renewalsEnded
	stopped chan struct{} // made by a halt that waits for them to end, closed when they have
	trust   time.Time     // the holder trusts the lease until then (monotonic)
	wall    int64         // and until then on its wall clock (Unix nanoseconds), whichever comes first
	rtt     time.Duration // the last confirmed round trip (the grant's, then each renewal's)

	token int64 // what Token reports instead of term, under mutant.LeaseTermReused
}

// newLease is the lease of a grant of id to owner, of term, sent at sent; its renewals are not started yet (start).
func (c *Client) newLease(id session.ID, owner string, term int64, sent time.Time, onEnd session.OnEnd) *Lease {
	l := &Lease{c: c, id: id, owner: owner, term: term, onEnd: onEnd, trust: c.trustFrom(sent), wall: c.trustFrom(sent).UnixNano(), rtt: time.Since(sent),
		rs: renewState{idx: -1}, addAt: -1}
	if mutant.On(mutant.LeaseTermReused) {
		first, _ := firstTerms.LoadOrStore(id, term)
		l.token = first.(int64)
	}
	return l
}

// start hands the lease to its Client's renewals (renewer.go), its first renewal due a renewal period after the
// send of its grant.
func (l *Lease) start() {
	l.started.Store(true)
	l.rs.next = time.Now().Add(l.c.cfg.Renew - l.rtt)
	l.c.r.add(l)
}

func (c *Client) trustFrom(sent time.Time) time.Time { return sent.Add(c.cfg.Length - c.cfg.Margin) }

// expired reports whether the holder has stopped trusting its lease by now: its trust window, counted from the
// send of the last confirmed grant or renewal, has passed on its monotonic clock, or on its wall clock, which only
// ever makes it shorter: the monotonic clock stops while the machine sleeps (a suspended laptop or VM), the wall
// clock does not. A wall clock that steps forward only ends the trust early; one that steps back changes nothing.
func (l *Lease) expired(now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return !now.Before(l.trust) || now.UnixNano() >= l.wall
}

// errTrustEnded is the loss of a lease whose trust window closed without a confirmed renewal.
func (l *Lease) errTrustEnded() error {
	return fmt.Errorf("%w: the lease was not renewed within its length (%v less a margin of %v)",
		session.ErrLockLost, l.c.cfg.Length, l.c.cfg.Margin)
}

func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// errNotYours is why a lease ends when the server says it is no longer its holder's: at the renewal that finds it.
var errNotYours = errors.New("the server no longer has the lease as this holder's: it was broken, or taken over once its " +
	"holder had stopped trusting it")

// finish ends the lease with cause, once: its owner is told first (onEnd), then Done closes, what AfterEnd arranged
// runs, and what onEnd asked to run after.
func (l *Lease) finish(cause error) {
	if cause == nil {
		cause = context.Canceled // an ended lease's Err is never nil
	}
	l.end.Finish(cause, l.onEnd)
}

// Done is closed when the lease ends: released, or lost (at the latest when its trust window closes).
func (l *Lease) Done() <-chan struct{} { return l.end.Done() }

// Err is nil while the lease is held; afterwards it says why it ended. It reads the clock: once the trust window has
// closed it reports the loss, even before its renewals (a goroutine that a starved machine may run late) have ended
// the lease and closed Done.
func (l *Lease) Err() error {
	if err := l.end.Err(); err != nil {
		return err
	}
	if l.expired(time.Now()) {
		return l.errTrustEnded()
	}
	return nil
}

// AfterEnd arranges for f to run once the lease ends; stop cancels that.
func (l *Lease) AfterEnd(f func()) (stop func() bool) { return l.end.AfterEnd(f) }

// Token is the lease's term: its fencing token.
func (l *Lease) Token() int64 {
	if l.token != 0 {
		return l.token // mutant.LeaseTermReused
	}
	return l.term
}

// firstTerms is, for mutant.LeaseTermReused, the first term this process was granted for each key.
var firstTerms sync.Map

// Target is what the lease holds (one of a wait's alternatives, maybe).
func (l *Lease) Target() session.Target { return session.Target{ID: l.id} }

// Owner is the lease's owner as its row names it.
func (l *Lease) Owner() string { return l.owner }

// PID is 0: a lease has no server session.
func (l *Lease) PID() uint32 { return 0 }

// Confirm asks the server whether the lease is still this holder's, and marks it held past its work (LingerSQL):
// one statement, sent after this call. It returns nil when the server has it as this owner's (and the holder
// still trusts it); the loss when not (the lease ends, as when a renewal finds that), or the lease's end when it
// ended first; an error matching ErrUnlockFailed when the statement got no answer (the lease goes on, renewed as
// before).
func (l *Lease) Confirm(ctx context.Context) error {
	if err := l.Err(); err != nil {
		return err
	}
	txt, _, err := exec(ctx, l.c.pool, l.c.cfg.Bound, LingerSQL(l.id, l.owner, l.term), false)
	switch {
	case l.released.Load():
		<-l.end.Done() // a Release raced the statement (and may have deleted the row first): it says how the lease ended
		return l.Err()
	case err == nil && txt == "1":
		return l.Err()
	case err == nil:
		l.finish(fmt.Errorf("%w: %w", session.ErrLockLost, errNotYours))
		l.halt() // nothing releases a lost lease: its renewals stop here, as they would on finding the loss themselves
		return l.Err()
	}
	return session.NotConfirmed(ctx, err)
}

// halt stops the lease's renewals and waits until they have ended: no renewal the loop takes an answer from after
// this returns, and a loss found meanwhile told.
func (l *Lease) halt() {
	l.stopOnce.Do(func() {
		l.stopping.Store(true)
		if l.started.Load() {
			l.c.r.halt(l)
		}
	})
	if !l.started.Load() {
		return
	}
	l.mu.Lock()
	if l.ended {
		l.mu.Unlock()
		return
	}
	if l.stopped == nil {
		l.stopped = make(chan struct{})
	}
	ch := l.stopped
	l.mu.Unlock()
	<-ch
}

// renewalsEnded says the lease's renewals have ended (the renewal loop's last word on it, or a halt's or a start's
// for a lease the loop never took); halts waiting return. Said again, it does nothing: a lease halted as it was
// started may be ended both by its start and by the loop the halt told.
func (l *Lease) renewalsEnded() {
	l.mu.Lock()
	if l.ended {
		l.mu.Unlock()
		return
	}
	l.ended = true
	ch := l.stopped
	l.mu.Unlock()
	if ch != nil {
		close(ch)
	}
}

// Release stops renewing and deletes the lease (keyed on owner and term); after is what Err reports then. It
// returns the loss when the lease had been lost, ErrLockLost when the server no longer had it as this owner's, and
// an error matching ErrUnlockFailed when the delete was not confirmed: the lease is no longer renewed, and is
// deleted apart as soon as the server answers (retire), or else taken over once another Locker has seen it
// unchanged for its length.
func (l *Lease) Release(ctx context.Context, after error) error {
	if !l.released.CompareAndSwap(false, true) {
		return session.ErrNotHeld
	}
	l.halt()
	if err := l.end.Err(); err != nil {
		return err
	}
	if l.expired(time.Now()) { // lost as its renewals were stopped: ended here, as they would have
		err := l.errTrustEnded()
		l.finish(err)
		l.c.retire([]session.ID{l.id}, l.owner, 0, false)
		return err
	}
	txt, _, err := exec(ctx, l.c.pool, l.c.cfg.Bound, ReleaseSQL(l.id, l.owner, l.term), false)
	switch {
	case err == nil && txt == "1":
		l.finish(after)
		return nil
	case err == nil:
		err = fmt.Errorf("%w: %w", session.ErrLockLost, errNotYours)
	default:
		l.c.retire([]session.ID{l.id}, l.owner, 0, false)
		err = session.WithContext(ctx, &releaseFailed{err})
	}
	l.finish(err)
	return err
}

// giveBack releases a lease its caller will not hold (granted as its call ended, or too late to be trusted): at
// once, and apart until the server confirms.
func (l *Lease) giveBack() {
	l.released.Store(true)
	l.halt()
	txt, _, err := exec(context.Background(), l.c.pool, l.c.cfg.Bound, ReleaseSQL(l.id, l.owner, l.term), false)
	if err != nil {
		l.c.retire([]session.ID{l.id}, l.owner, 0, false)
	}
	_ = txt
	l.finish(session.ErrNotHeld)
}

// releaseFailed is a release the server did not confirm: it matches ErrUnlockFailed, and says what becomes of the
// lease (the sentinel's own text speaks of a session).
type releaseFailed struct{ cause error }

func (e *releaseFailed) Error() string {
	return "advlock: lease release not confirmed (" + e.cause.Error() + "): it is no longer renewed, and is deleted as " +
		"soon as the server answers; until then another Locker takes it over once it has seen it unchanged for its length"
}
func (e *releaseFailed) Is(target error) bool { return target == session.ErrUnlockFailed }
func (e *releaseFailed) Unwrap() error        { return e.cause }

// Ensure makes sure the lease tables and functions exist, creating what is missing, on a connection of the pool;
// it learns the server's clock on the way. A standby gets ErrStandby; a role that may neither find nor create them
// gets ErrLeaseTable, saying what to run.
func (c *Client) Ensure(ctx context.Context) error {
	err := c.ensure(ctx)
	if err != nil {
		return err
	}
	c.startSweep()
	for _, m := range []struct {
		name      string
		old, mutd string
	}{
		{mutant.LeaseNoRestartQuiet, restartQuiet, ""},
		{mutant.LeaseRestartTermKept, termJump, ""},
		{mutant.LeaseServerExpiry, heldCheck, heldCheck + " OR r_term IS NOT NULL AND r_exp >= now_us"},
	} {
		if mutant.On(m.name) {
			f := strings.Replace(grantDDL, m.old, m.mutd, 1)
			if f == grantDDL {
				panic("lease: mutant " + m.name + " found nothing to change")
			}
			_, _, err = exec(ctx, c.pool, c.cfg.Bound, "SELECT pg_advisory_xact_lock("+ddlKey+");\nCREATE OR REPLACE "+f+"SELECT 1", false)
		}
	}
	return err
}

func (c *Client) ensure(ctx context.Context) error {
	bound := c.cfg.Bound
	for attempt := 0; ; attempt++ {
		txt, _, err := exec(ctx, c.pool, bound, ExistsSQL, false)
		if err != nil {
			return fmt.Errorf("check the lease table: %w", err)
		}
		var exists, standby, update, boot, room, unlogged int
		var srv int64
		if _, err := fmt.Sscan(txt, &exists, &standby, &srv, &update, &boot, &room, &unlogged); err != nil {
			return fmt.Errorf("check the lease table: unexpected answer %q", txt)
		}
		c.clock.sample(time.Now(), srv)
		if exists == 1 && update == 0 {
			return fmt.Errorf("%w: this role may not move the sequence %s, which the first lease granted after a server's "+
				"crash does (past the terms the crash may have taken back); as its owner run: GRANT USAGE, UPDATE ON "+
				"SEQUENCE %[2]s TO <role>", session.ErrFencing, session.FenceSeq)
		}
		if room == 0 {
			return fmt.Errorf("%w: the sequence %s may not grow to 2^62 (made AS integer, or with a small MAXVALUE): the "+
				"first lease granted after a server's crash moves it 2^32 on; as its owner run: ALTER SEQUENCE %[2]s AS "+
				"bigint MAXVALUE 9223372036854775807", session.ErrFencing, session.FenceSeq)
		}
		if exists == 1 && unlogged == 0 {
			return fmt.Errorf("%w: the table %s is not UNLOGGED, so a crash does not empty it and leases would not wait "+
				"after one; as its owner run: ALTER TABLE %[2]s SET UNLOGGED", ErrLeaseTable, Boot)
		}
		if exists == 1 && boot == 0 {
			return fmt.Errorf("%w: this role may not read and write the tables %s and %s, which grants do; as their owner "+
				"run: GRANT SELECT, INSERT, UPDATE, DELETE ON %[2]s, %[3]s TO <role>", ErrLeaseTable, Boot, Timelines)
		}
		if exists == 1 {
			return nil
		}
		if standby == 1 {
			return fmt.Errorf("%w (the lease tables are not there either: create them on the primary)", session.ErrStandby)
		}
		_, _, err = exec(ctx, c.pool, bound, CreateSQL, false)
		switch code := session.SQLState(err); {
		case err == nil:
		case code == "42501":
			return fmt.Errorf("%w: the tables %s, %s, %s and %s, or their functions, are missing and this role may not "+
				"create them (it needs CREATE on schema public; the server said: %v); as a role that may, run "+
				"advlock.LeaseTableSQL, then GRANT SELECT, INSERT, UPDATE, DELETE ON %[2]s, %[3]s, %[4]s, %[5]s TO <role>",
				ErrLeaseTable, Table, Timelines, Waits, Boot, err)
		case code == "25006":
			return fmt.Errorf("create the lease tables: %w", session.ReadOnly(err))
		case (code == "23505" || code == "42P07" || code == "42710" || code == "42723") && attempt < 5:
			// Created by another client at the same moment (its row type, its table or a function was there first;
			// that client's one transaction made them, and has committed): look again.
			continue
		default:
			return fmt.Errorf("create the lease table: %w", err)
		}
	}
}

// ErrLeaseTable is what a lease call returns when the lease tables can neither be found nor created by this role.
var ErrLeaseTable = errors.New("advlock: lease table unavailable")
