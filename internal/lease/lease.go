// Package lease holds locks as rows of a table instead of session locks: every statement is one short autocommit
// statement without parameters, which any pooler (in any mode) and any driver carries. A lease is a sibling of a
// held session lock (internal/session): the root package holds either through the same small handle (Done, Err,
// Release, AfterEnd, Token, PID).
//
//	grant (a conditional upsert: free, or the holder's lease expired) -> renew every Config.Renew (keyed on owner
//	and term) -> release (a delete keyed on owner and term), or lost: taken over, or not renewed in time
//
// The holder trusts its lease until its own monotonic clock, counted from the moment it sent the statement that
// granted or last renewed it, reaches Length less Margin: the server computed the expiry on its own clock when it
// ran that statement, later than the send, so the holder stops trusting first, whatever the offset between the
// two wall clocks. Done closes then at the latest.
package lease

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// Config is what a Locker's leases are made of.
type Config struct {
	Length time.Duration // how long a grant or renewal lasts on the server's clock
	Renew  time.Duration // how often a held lease is renewed
	Margin time.Duration // the holder stops trusting its lease this long before Length after its last send
	Poll   time.Duration // how often a waiting Lock tries again (with jitter)
	Bound  time.Duration // how long one statement may go unanswered (a grant, a release)
	Holder string        // who holds, for people (advlock ls)
}

// Defaults: a 15 s lease renewed every 5 s, so that two renewals in a row may fail (a database restarting, a
// network blip) before the holder stops trusting it, trust ending 1 s before the lease, and a dead holder's key
// free again within 15 s; waits try about 5 times a second.
func Defaults() Config {
	return Config{Length: 15 * time.Second, Renew: 5 * time.Second, Margin: time.Second, Poll: 200 * time.Millisecond,
		Bound: 5 * time.Second}
}

// Lease is one held lease.
type Lease struct {
	pool  session.Pool
	id    session.ID
	owner string
	term  int64
	cfg   Config
	onEnd session.OnEnd

	ctx      context.Context
	end      context.CancelCauseFunc
	endOnce  sync.Once
	released atomic.Bool
	stop     chan struct{} // closed to stop the renewer (halt)
	stopOnce sync.Once
	stopped  chan struct{} // closed when the renewer has returned

	mu    sync.Mutex
	trust time.Time // the holder trusts the lease until then (monotonic)

	token int64 // what Token reports instead of term, under mutant.LeaseTermReused
}

// errQuiet is a grant refused because the server's timeline is younger than one lease length (see GrantSQL).
var errQuiet = errors.New("the server was promoted less than one lease length ago: no lease is granted until then")

// Take tries once to take id's lease: ErrNotAcquired when another lease holds it. The grant, once sent, is not cut
// by ctx (only by its bound): cut, its outcome would be unknown, and the server could still grant it after the
// delete sent to undo it had found nothing, leaving a lease that nobody holds until it expires. A grant that ctx's
// end raced is given back, and the call returns ctx's error. A statement whose outcome is unknown all the same (an
// error, its bound passed) is undone: whatever it may have granted to this owner is deleted.
func Take(ctx context.Context, pool session.Pool, id session.ID, cfg Config, onEnd session.OnEnd) (*Lease, error) {
	l, err := take(ctx, pool, id, cfg, onEnd, "")
	if ctx.Err() == nil {
		return l, err
	}
	// The call ran out of time, or was cancelled, while its grant ran: it says so, as a try on a session does,
	// whatever the grant's answer.
	switch {
	case err == nil:
		_ = l.Release(context.Background(), session.ErrNotHeld)
		return nil, session.WithContext(ctx, ctx.Err())
	case errors.Is(err, session.ErrNotAcquired):
		return nil, session.WithContext(ctx, ctx.Err())
	}
	return nil, session.WithContext(ctx, err)
}

// take is Take for waiter ("" for a try): see GrantSQL. ctx bounds the wait for a connection; the grant runs to its
// end within cfg.Bound.
func take(ctx context.Context, pool session.Pool, id session.ID, cfg Config, onEnd session.OnEnd, waiter string) (*Lease, error) {
	owner := newOwner()
	sent := time.Now()
	r, out, err := runWhole(ctx, pool, cfg.Bound, GrantSQL(id, owner, cfg.Holder, cfg.Length, waiter))
	if err != nil {
		if out { // its outcome is unknown
			undo(pool, id, owner, cfg.Bound)
		}
		if code := session.SQLState(err); code == "25006" || code == "55000" { // read-only, or "recovery is in progress": a standby
			return nil, session.ErrStandby
		}
		return nil, err
	}
	switch {
	case r == resultHeld:
		return nil, session.ErrNotAcquired
	case r == resultQuiet:
		return nil, fmt.Errorf("%w: %w", session.ErrNotAcquired, errQuiet)
	case r < 0:
		undo(pool, id, owner, cfg.Bound)
		return nil, fmt.Errorf("advlock: unexpected lease result %d", r)
	}
	if mutant.On(mutant.LeaseTrustFromReply) {
		sent = time.Now()
	}
	l := &Lease{pool: pool, id: id, owner: owner, term: r, cfg: cfg, onEnd: onEnd, trust: trustFrom(sent, cfg),
		stop: make(chan struct{}), stopped: make(chan struct{})}
	if mutant.On(mutant.LeaseTermReused) {
		first, _ := firstTerms.LoadOrStore(id, r)
		l.token = first.(int64)
	}
	l.ctx, l.end = context.WithCancelCause(context.Background())
	go l.renew()
	return l, nil
}

// Wait takes id's lease, or any of alts' (a semaphore's other slots), trying them in turn every Poll or so
// (jittered) while other leases hold them, until one is granted or ctx ends (a deadline is a bound of the wait, as
// a session lock's lock_timeout: the error wraps context.DeadlineExceeded). A statement on the wire is not cut by
// ctx's deadline, only by its bound; a grant that a cancel raced is given back.
func Wait(ctx context.Context, pool session.Pool, id session.ID, alts []session.ID, cfg Config, onEnd session.OnEnd) (*Lease, error) {
	ids := append([]session.ID{id}, alts...)
	waiter := newOwner()
	queued := false // a try found a key held: the wait may have rows in Waits
	for {
		var l *Lease
		var err error
		for _, id := range ids {
			if l, err = take(context.WithoutCancel(ctx), pool, id, cfg, onEnd, waiter); !errors.Is(err, session.ErrNotAcquired) {
				break
			}
			queued = true
		}
		if !errors.Is(err, session.ErrNotAcquired) {
			if err == nil && ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				// Cancelled while the grant was on the wire: give it back, the caller has gone.
				_ = l.Release(context.Background(), session.ErrNotHeld)
				return nil, session.WithContext(ctx, ctx.Err())
			}
			if err != nil && queued {
				leave(pool, waiter, cfg.Bound)
			}
			return l, err // a grant deleted the wait's rows
		}
		d := cfg.Poll/2 + time.Duration(rand.Int64N(int64(cfg.Poll)))
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d {
			d = max(time.Until(dl), 0)
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			leave(pool, waiter, cfg.Bound)
			return nil, session.WithContext(ctx, fmt.Errorf("lease not granted before the wait ended: %w", err))
		}
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
			leave(pool, waiter, cfg.Bound)
			return nil, session.WithContext(ctx, fmt.Errorf("lease not granted before the deadline: %w", err))
		}
	}
}

func trustFrom(sent time.Time, cfg Config) time.Time { return sent.Add(cfg.Length - cfg.Margin) }

func newOwner() string {
	var b [16]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// run sends one statement on a connection of pool and gives the connection back (a lease holds nothing on it):
// bounded by bound, and by ctx's cancellation.
func run(ctx context.Context, pool session.Pool, bound time.Duration, sql string) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	c, err := pool.Acquire(ctx)
	if err != nil {
		return 0, session.WithContext(ctx, fmt.Errorf("acquire connection: %w", err))
	}
	r, err := c.QueryInt(ctx, sql)
	if err != nil || ctx.Err() != nil {
		c.Destroy()
		if err == nil {
			err = ctx.Err()
		}
		return 0, session.WithContext(ctx, err)
	}
	c.Release()
	return r, nil
}

// runWhole is run whose statement, once sent, ctx does not cut (only bound): ctx bounds the wait for a connection,
// and nothing is sent once it has ended. sent says whether the statement went out.
func runWhole(ctx context.Context, pool session.Pool, bound time.Duration, sql string) (r int64, sent bool, err error) {
	actx, cancel := context.WithTimeout(ctx, bound)
	c, err := pool.Acquire(actx)
	cancel()
	if err != nil {
		return 0, false, session.WithContext(actx, fmt.Errorf("acquire connection: %w", err))
	}
	if err := ctx.Err(); err != nil {
		c.Release()
		return 0, false, session.WithContext(ctx, err)
	}
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), bound)
	defer cancel()
	r, err = c.QueryInt(qctx, sql)
	if err != nil {
		c.Destroy()
		return 0, true, session.WithContext(qctx, err)
	}
	c.Release()
	return r, true, nil
}

// leave deletes the rows of a wait that ends without a grant, so that it holds back nobody (a row it cannot delete
// stops counting WaitStale after its last poll).
func leave(pool session.Pool, waiter string, bound time.Duration) {
	_, _ = run(context.Background(), pool, bound, LeaveSQL(waiter))
}

// undo deletes whatever lease of id a grant in doubt may have given owner.
func undo(pool session.Pool, id session.ID, owner string, bound time.Duration) {
	_, _ = run(context.Background(), pool, bound, UndoSQL(id, owner))
}

// renew keeps the lease until Release stops it or it is lost: it renews every Renew, and ends the lease when the
// trust window closes without a confirmed renewal, or when the server says the lease is no longer this owner's.
func (l *Lease) renew() {
	defer close(l.stopped)
	next := time.Now().Add(l.cfg.Renew)
	for {
		l.mu.Lock()
		trust := l.trust
		l.mu.Unlock()
		wake := time.NewTimer(min(time.Until(next), time.Until(trust)))
		select {
		case <-l.stop:
			wake.Stop()
			return
		case <-wake.C:
		}
		if !time.Now().Before(trust) {
			l.finish(fmt.Errorf("%w: the lease was not renewed within its length (%v less a margin of %v)",
				session.ErrLockLost, l.cfg.Length, l.cfg.Margin))
			return
		}
		if time.Now().Before(next) {
			continue
		}
		sent := time.Now()
		ctx, cancel := context.WithDeadline(context.Background(), trust)
		go func() { // Release stops a renewal on the wire
			select {
			case <-l.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		sql := RenewSQL(l.id, l.owner, l.term, l.cfg.Length)
		if mutant.On(mutant.LeaseRenewUnkeyed) {
			sql = renewUnkeyedSQL(l.id, l.cfg.Length)
		}
		r, err := run(ctx, l.pool, l.cfg.Bound, sql)
		cancel()
		if mutant.On(mutant.LeaseTrustFromReply) {
			sent = time.Now()
		}
		switch {
		case err == nil && r == 1:
			l.mu.Lock()
			l.trust = trustFrom(sent, l.cfg)
			l.mu.Unlock()
			next = sent.Add(l.cfg.Renew)
		case err == nil:
			l.finish(fmt.Errorf("%w: the lease expired, or was taken over or broken", session.ErrLockLost))
			return
		default:
			next = time.Now().Add(min(l.cfg.Renew/5, time.Second)) // try again soon, while the trust lasts
		}
	}
}

func (l *Lease) finish(cause error) {
	l.endOnce.Do(func() {
		var after func()
		if l.onEnd != nil {
			after = l.onEnd(cause)
		}
		l.end(cause)
		if after != nil {
			after()
		}
	})
}

// Done is closed when the lease ends: released, or lost (at the latest when its trust window closes).
func (l *Lease) Done() <-chan struct{} { return l.ctx.Done() }

// Err is nil while the lease is held; afterwards it says why it ended.
func (l *Lease) Err() error { return context.Cause(l.ctx) }

// AfterEnd arranges for f to run once the lease ends; stop cancels that.
func (l *Lease) AfterEnd(f func()) (stop func() bool) { return context.AfterFunc(l.ctx, f) }

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

// PID is 0: a lease has no server session.
func (l *Lease) PID() uint32 { return 0 }

// Confirm asks the server whether the lease is still this holder's, and marks it held past its work (LingerSQL):
// one statement, sent after this call. It returns nil when the server has it as this owner's and unexpired; the
// loss when not (the lease ends, as when the renewer finds that), or the lease's end when it ended first; an error
// matching ErrUnlockFailed when the statement got no answer (the lease goes on, renewed as before).
func (l *Lease) Confirm(ctx context.Context) error {
	if err := l.Err(); err != nil {
		return err
	}
	r, err := run(ctx, l.pool, l.cfg.Bound, LingerSQL(l.id, l.owner, l.term))
	switch {
	case l.released.Load():
		<-l.ctx.Done() // a Release raced the statement (and may have deleted the row first): it says how the lease ended
		return l.Err()
	case err == nil && r == 1:
		return l.Err()
	case err == nil:
		l.finish(fmt.Errorf("%w: the lease expired, or was taken over or broken", session.ErrLockLost))
		l.halt() // nothing releases a lost lease: its renewer stops here, as it would on finding the loss itself
		return l.Err()
	}
	return session.NotConfirmed(ctx, err)
}

// halt stops the renewer and waits for it to return.
func (l *Lease) halt() {
	l.stopOnce.Do(func() { close(l.stop) })
	<-l.stopped
}

// Release stops renewing and deletes the lease (keyed on owner and term); after is what Err reports then. It
// returns the loss when the lease had been lost, ErrLockLost when the server no longer had it as this owner's, and
// ErrUnlockFailed when the delete was not confirmed (the lease then ends at its expiry, not renewed).
func (l *Lease) Release(ctx context.Context, after error) error {
	if !l.released.CompareAndSwap(false, true) {
		return session.ErrNotHeld
	}
	l.halt()
	if err := l.Err(); err != nil {
		return err
	}
	r, err := run(ctx, l.pool, l.cfg.Bound, ReleaseSQL(l.id, l.owner, l.term))
	switch {
	case err == nil && r == 1:
		l.finish(after)
		return nil
	case err == nil:
		err = fmt.Errorf("%w: the lease was no longer this holder's (expired and taken over, or broken)", session.ErrLockLost)
	default:
		err = fmt.Errorf("%w: the lease is not renewed and ends at its expiry: %w", session.ErrUnlockFailed, err)
	}
	l.finish(err)
	return err
}

// Ensure makes sure the lease tables exist, creating them where missing, on a connection of pool. A role that may
// neither find nor create them gets ErrLeaseTable, saying what to run.
func Ensure(ctx context.Context, pool session.Pool, bound time.Duration) error {
	err := ensure(ctx, pool, bound)
	if err == nil && mutant.On(mutant.LeaseNoQuiet) {
		_, err = run(ctx, pool, bound, noQuietSQL())
	}
	return err
}

// noQuietSQL replaces the grant function with one without the quiet period (mutant.LeaseNoQuiet).
func noQuietSQL() string {
	f := strings.Replace(grantDDL, "  IF tl > 1 THEN\n", "  IF false THEN\n", 1)
	if f == grantDDL {
		panic("lease: mutant " + mutant.LeaseNoQuiet + " found no quiet period to skip")
	}
	return "SELECT pg_advisory_xact_lock(" + ddlKey + ");\n" + f + "SELECT 1"
}

func ensure(ctx context.Context, pool session.Pool, bound time.Duration) error {
	for attempt := 0; ; attempt++ {
		r, err := run(ctx, pool, bound, ExistsSQL)
		if err != nil {
			return fmt.Errorf("check the lease table: %w", err)
		}
		if r == 1 {
			return nil
		}
		_, err = run(ctx, pool, bound, CreateSQL)
		switch code := session.SQLState(err); {
		case err == nil:
		case code == "42501":
			return fmt.Errorf("%w: the tables %s, %s and %s, or their functions, are missing and this role may not "+
				"create them (it needs CREATE on schema public); as a role that may, run advlock.LeaseTableSQL, then GRANT "+
				"SELECT, INSERT, UPDATE, DELETE ON %[2]s, %[3]s, %[4]s TO <role>: %[5]v", ErrLeaseTable, Table, Timelines, Waits, err)
		case (code == "23505" || code == "42P07" || code == "42710") && attempt < 5:
			// Created by another client at the same moment (its row type, its table or its index was there first;
			// that client's one transaction made the tables and functions, and has committed): look again.
			continue
		default:
			return fmt.Errorf("create the lease table: %w", err)
		}
	}
}

// ErrLeaseTable is what a lease call returns when the lease tables can neither be found nor created by this role.
var ErrLeaseTable = errors.New("advlock: lease table unavailable")
