package advlock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// Lead campaigns for key and runs fn while this process leads: it waits until elected (in the server, with no
// polling; a Locker of leases polls its table about 5 times a second, see [WithLeases]), runs fn with a context
// that is cancelled when leadership is lost (the session ended, or the lease) or ctx ends, releases leadership
// when fn returns (also when fn panics: it steps down, then the panic goes on), and campaigns again, until ctx
// ends (Lead then returns ctx's error) or fn returns an error while its context was still live (Lead returns it:
// the loss did not cause it), unless that error matches ErrLockLost (fn found out itself that it no longer leads,
// say a write refused for its fencing token: it campaigns again). What ended a term is judged from fn's context at
// the moment fn returns: if it had been cancelled because the lock was lost (cause ErrLockLost), fn's error is
// taken as the loss's doing and this process campaigns again after a short backoff (50 to 150 ms).
//
// A campaign that fails for any other reason (the database down or restarting, a connection terminated, a
// standby that is not promoted yet, no connection free to check a new one, a full lock table) is tried again with
// a backoff that grows to 1 s (0.5 to 1.5 s with jitter), logged by [WithLogger] and counted in [Stats]
// (CampaignRetries). What an operator must fix, and what Lock refuses at once whatever the server's state, ends
// Lead: ErrClosed, ErrNoPool (also a pool closed under the Locker), ErrInvalidKey, ErrTxPooling, ErrFencing (which
// is only ever a missing privilege), ErrLeaseTable, errors.ErrUnsupported (a campaign Lock refuses, such as one
// without a bound on a Locker of leases inside Do's fn), a primary that refuses writes (SQLSTATE 25006,
// default_transaction_read_only: leases and fencing tokens write), the server refusing the role or knowing no such
// database (SQLSTATE class 28, 3D000), and ErrDeadlock: a campaign run where its caller holds locks (inside Do's
// fn, or with [Holding]) whose wait closed a cycle of waits gives up, so that its caller can release what it
// holds; campaigning again while holding them would close the cycle again.
//
// fn is the leader's work: it should run until its ctx ends (or fail), since leadership lasts only while it runs.
// An fn that returns nil within a second (one that starts its work in the background and returns, say) makes
// Lead back off before it campaigns again, from 50 ms doubling to 1 s (with jitter), so that other processes may
// lead meanwhile; [WithLogger] says so once per Lead call.
//
// fn gets the leader's fencing token through [FenceToken] when the Locker has [WithFencing] (or [WithLeases]):
// every term's token is greater than the last, so a deposed leader that was paused can be refused by what it
// writes to. Lead suits "one pod runs the scheduler": the leader's lock is a lock like any other of its Locker (a
// session lock, or a lease), which advlock ls shows and [Leader] reads from any process. So that advlock ls can
// show the leader of a [NameKey] by its name, Lead writes the name to the table public.advlock_names once per
// Locker and name, beside its first term's fn, creating the table if it is missing; a role that may not write it
// leads all the same (WithLogger says so once). See docs/locks.md, Leader election.
func (l *Locker) Lead(ctx context.Context, key Key, fn func(ctx context.Context) error) error {
	if l != nil {
		l.campaigning.Add(1)
		defer l.campaigning.Add(-1)
	}
	backoff := 50 * time.Millisecond     // after a failed campaign
	termBackoff := 50 * time.Millisecond // after a term that fn ended at once (shortTerm)
	warned := false
	for {
		campaign := l.Lock
		if mutant.On(mutant.LeadShared) {
			campaign = l.RLock
		}
		lk, err := campaign(ctx, key)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if leadEnds(err) {
				err = fmt.Errorf("advlock: lead %s: %w", key, err)
				if !errors.Is(err, ErrClosed) { // Close is an ordinary end, not a failure
					l.campaignFailed(key, err, 0)
				}
				return err
			}
			wait := jitter(backoff)
			l.campaignFailed(key, err, wait)
			if !sleep(ctx, wait) {
				return ctx.Err()
			}
			backoff = min(2*backoff, maxCampaignBackoff)
			continue
		}
		backoff = 50 * time.Millisecond
		began := time.Now()
		ferr, lost := l.term(ctx, lk, fn)
		switch {
		case ferr != nil && !lost:
			return ferr // fn's own error: its context was live when it returned
		case ctx.Err() != nil:
			return ctx.Err()
		case lost: // step down, then campaign again
			if !sleep(ctx, jitter(100*time.Millisecond)) {
				return ctx.Err()
			}
		case time.Since(began) < shortTerm:
			// fn returned nil at once: leadership lasts only while fn runs, so an fn that starts its work in the
			// background and returns would make this process campaign and lead again and again. Back off (other
			// processes may lead meanwhile), and say so once.
			if !warned {
				warned = true
				l.shortTerm(key, time.Since(began))
			}
			if !sleep(ctx, jitter(termBackoff)) {
				return ctx.Err()
			}
			termBackoff = min(2*termBackoff, maxCampaignBackoff)
		default:
			termBackoff = 50 * time.Millisecond
		}
	}
}

// shortTerm is how long a term must last for Lead to campaign again at once after fn returned nil; after a shorter
// one it backs off, from 50 ms doubling to maxCampaignBackoff.
const shortTerm = time.Second

// term runs fn as the leader holding lk and steps down when fn returns or panics. lost reports whether fn's
// context had been cancelled by the loss of the lock when fn returned; ferr is fn's error unless the Lead's own ctx
// had ended by then (then the caller returns ctx's error).
func (l *Locker) term(ctx context.Context, lk *Lock, fn func(ctx context.Context) error) (ferr error, lost bool) {
	l.leading.Add(1)
	fctx, cancel := context.WithCancelCause(Holding(ctx, lk))
	stop := lk.h.AfterEnd(func() { cancel(lk.Err()) })
	published := l.publishName(fctx, lk.key)
	defer func() { // also when fn panics: nobody else would ever lead
		stop()
		cancel(nil)
		uctx, ucancel := context.WithTimeout(context.WithoutCancel(ctx), l.opts.ReleaseTimeout)
		defer ucancel()
		if uerr := lk.Unlock(uctx); errors.Is(uerr, ErrLockLost) && ferr == nil {
			lost = true // lost while fn ran, noticed by the unlock: campaign again after the backoff
		}
		<-published // cut by the term's end if it had not answered yet
		l.leading.Add(-1)
	}()
	if err := lk.Err(); err != nil {
		cancel(err) // lost before fn starts: its ctx says so from the start (AfterEnd runs f in a goroutine)
	}
	ferr = fn(fctx)
	if fctx.Err() != nil { // judged now, before anything else moves: who ended fn's context?
		lost = errors.Is(context.Cause(fctx), ErrLockLost)
		if !lost {
			ferr = nil // ctx ended: the caller returns ctx's error
		}
	}
	if errors.Is(ferr, ErrLockLost) {
		lost = true // fn says it lost leadership (a write refused by its fencing token, say): campaign again
	}
	if h := testHookTermJudged.Load(); h != nil {
		(*h)(lost)
	}
	return ferr, lost
}

// publishName writes the name of key, a NameKey, to the names table (session.NamesTable) once per Locker, so that
// advlock ls shows the leader's key by its name; a term's first one writes it, apart from fn, until the term ends.
// It is best effort: the first failure is logged (WithLogger), and Lead leads on; a role that may not write the
// table is not asked again, nor is a name the database cannot hold; after a passing failure the next term tries
// again. The channel is closed once it has returned.
func (l *Locker) publishName(ctx context.Context, key Key) <-chan struct{} {
	done := make(chan struct{})
	v, ok := key.Int64()
	if !ok || key.kind != kindName || len(key.name) > session.MaxPublishedName || l.namesOff.Load() {
		close(done)
		return done
	}
	if _, had := l.names.LoadOrStore(v, struct{}{}); had {
		close(done)
		return done
	}
	go func() {
		defer close(done)
		badName, noRole, err := session.PublishName(ctx, l.pool, v, key.name, 5*time.Second)
		switch {
		case err == nil || badName: // a name the database cannot hold is not tried again; the others are
		case noRole:
			l.namesOff.Store(true)
		default:
			l.names.Delete(v) // the next term tries again (a standby not promoted yet, the network, the pool)
		}
		if err != nil && ctx.Err() == nil && !l.namesWarned.Swap(true) {
			l.nameNotPublished(key, err)
		}
	}()
	return done
}

// testHookTermJudged, in tests only, is told what a term judged as fn returned, before the step down.
var testHookTermJudged atomic.Pointer[func(lost bool)]

// maxCampaignBackoff caps the pause between failed campaigns: a database that is down or failing over is tried
// about once a second (0.5 to 1.5 s with jitter), so a leader is back soon after the server is.
const maxCampaignBackoff = time.Second

// leadEnds reports whether a campaign's error is one an operator must fix, or one that Lock returns at once
// whatever the state of the server: trying again cannot help. Besides the sentinels (ErrLeaseTable: the lease
// tables missing and this role may not create them; errors.ErrUnsupported: a wait Lock refuses, such as one without
// a bound on a Locker of leases whose caller holds locks), the server refusing the role or naming no such
// database (SQLSTATE class 28, 3D000), and a primary that refuses writes (25006: read-only by a setting; a lease or
// a fencing token must write).
func leadEnds(err error) bool {
	for _, fatal := range []error{ErrClosed, ErrNoPool, ErrInvalidKey, ErrTxPooling, ErrFencing, ErrDeadlock,
		ErrLeaseTable, errors.ErrUnsupported, session.ErrReadOnly} {
		if errors.Is(err, fatal) {
			return true
		}
	}
	code := session.SQLState(err)
	return strings.HasPrefix(code, "28") || code == "3D000"
}

// jitter spreads d over [d/2, 3d/2).
func jitter(d time.Duration) time.Duration { return d/2 + time.Duration(rand.Int64N(int64(d))) }

// sleep waits d or until ctx ends; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Leadership is who leads a key, as the server saw it at Observed.
type Leadership struct {
	LockInfo           // the leader's lock: its session's PID, ApplicationName, ClientAddr, BackendStart; for a lease, its Lease
	Observed time.Time // when the server was asked (its clock)
}

// Leader is the package's [Leader] through the Locker's own pool: its *pgxpool.Pool, or with advsql the *sql.DB it
// locks through (see [Locker.Inspect]). It answers for the Locker's own kind of lock: the lease of key for a
// Locker [WithLeases], the session lock otherwise.
func (l *Locker) Leader(ctx context.Context, key Key) (Leadership, bool, error) {
	var who Leadership
	var ok bool
	err := l.query(ctx, func(ctx context.Context, q Querier) error {
		var err error
		leases := l.leases != nil
		who, ok, err = leader(ctx, q, key, func(li LockInfo) bool { return (li.Lease != nil) == leases })
		return err
	})
	return who, ok, err
}

// Leader reports who leads key now (holds it exclusively), from any process, through conn (a *pgxpool.Pool,
// *pgx.Conn or pgx.Tx): false when nobody does. It reads pg_locks and the leases like [Inspect]: the holder of
// key's session lock, else of its lease.
func Leader(ctx context.Context, conn Querier, key Key) (Leadership, bool, error) {
	return leader(ctx, conn, key, func(LockInfo) bool { return true })
}

func leader(ctx context.Context, conn Querier, key Key, kind func(LockInfo) bool) (Leadership, bool, error) {
	rows, err := conn.Query(ctx, "SELECT now()")
	if err != nil {
		return Leadership{}, false, fmt.Errorf("advlock: leader: %w", err)
	}
	var now time.Time
	for rows.Next() {
		if err := rows.Scan(&now); err != nil {
			rows.Close()
			return Leadership{}, false, fmt.Errorf("advlock: leader: %w", err)
		}
	}
	rows.Close()
	locks, err := Inspect(ctx, conn)
	if err != nil {
		return Leadership{}, false, err
	}
	for _, li := range locks {
		if li.Granted && !li.Shared && li.Key.Equal(key) && kind(li) {
			li.Key = key
			return Leadership{LockInfo: li, Observed: now}, true, nil
		}
	}
	return Leadership{Observed: now}, false, nil
}
