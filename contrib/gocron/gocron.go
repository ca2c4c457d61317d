// Package advlockgocron runs gocron (github.com/go-co-op/gocron/v2) schedulers on several processes with
// PostgreSQL advisory locks from package advlock: an [Elector], so that only the leader schedules jobs, and a
// [Locker], so that no two runs of one job overlap. It is a module of its own, so that the core module does not
// depend on gocron.
//
//	locks, err := advlock.Open(ctx, dsn)
//	if err != nil {
//		return err // a malformed DSN (Open does not connect)
//	}
//	elector := advlockgocron.NewElector(ctx, locks, "billing")
//	defer elector.Close()
//	s, err := gocron.NewScheduler(gocron.WithDistributedElector(elector))
//
// or, job by job: gocron.WithDistributedLocker(advlockgocron.NewLocker(locks)), whose minimum hold makes a job
// run once per tick on schedulers whose clocks differ (see Locker).
package advlockgocron

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/advlock/advlock"
	"github.com/go-co-op/gocron/v2"
)

// ErrNotLeader is what IsLeader returns on a process that does not lead.
var ErrNotLeader = errors.New("advlockgocron: this process does not lead")

// Elector is a gocron.Elector: IsLeader answers nil while this process leads the election name, which it
// campaigns for in the background ([advlock.Locker.Lead]) from NewElector until Close. Leadership is lost when the
// leader's session ends (terminated, network loss, server restart, the process frozen past the keepalive bound);
// IsLeader then answers ErrNotLeader at once and the process campaigns again. Between the server ending a leader's
// session and that process noticing (about a millisecond) both it and the next leader may answer nil.
type Elector struct {
	leading atomic.Bool
	closed  atomic.Bool
	cancel  context.CancelFunc
	done    chan struct{}
	err     error
}

var _ gocron.Elector = (*Elector)(nil)

// NewElector starts campaigning for name (the key NameKey("gocron/elector/"+name)) with l, until ctx ends or Close.
func NewElector(ctx context.Context, l *advlock.Locker, name string) *Elector {
	ctx, cancel := context.WithCancel(ctx)
	e := &Elector{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(e.done)
		e.err = l.Lead(ctx, advlock.NameKey("gocron/elector/"+name), func(ctx context.Context) error {
			e.leading.Store(true)
			<-ctx.Done() // lost, or the campaign ends
			e.leading.Store(false)
			return nil
		})
	}()
	return e
}

// IsLeader answers nil while this process leads, else ErrNotLeader; once the campaign has ended for another
// reason than Close (an error that retrying cannot fix, such as advlock.ErrTxPooling or a missing privilege for
// fencing), it answers that error, wrapped, for ever, instead of ErrNotLeader: no process may be leading.
func (e *Elector) IsLeader(context.Context) error {
	if e.leading.Load() {
		return nil
	}
	select {
	case <-e.done:
		if e.err != nil && !e.closed.Load() {
			return fmt.Errorf("advlockgocron: the campaign ended: %w", e.err)
		}
	default:
	}
	return ErrNotLeader
}

// Close stops campaigning (releasing leadership if held) and waits for it. It returns the campaign's error when it
// ended for another reason than Close (an error retrying cannot fix, such as advlock.ErrTxPooling).
func (e *Elector) Close() error {
	e.closed.Store(true)
	e.cancel()
	<-e.done
	if errors.Is(e.err, context.Canceled) {
		return nil
	}
	return e.err
}

// Locker is a gocron.Locker: each run of a job takes the job's key without waiting, so that when several
// schedulers start the same job only one runs it (the others skip that run), and keeps it held for at least a
// minimum hold after the grant (advlock.HoldAtLeast), also when the run is quicker: a scheduler whose clock or
// start is later by less than the hold finds the key held and skips the run the first one made.
//
// What it guarantees, for schedulers whose clocks and start times differ by at most S:
//
//   - with the default key (NameKey("gocron/job/"+name)) and a minimum hold h: one run per tick when S < h and
//     h < the interval - S (the hold must end before the next tick's first scheduler fires). The default h is
//     1 s: for cron jobs (a minute apart or more) and interval jobs of 2 s or more, with clocks within a second.
//     A job more frequent than that needs WithMinimumHold below half its interval, or WithTickKeys;
//   - with WithTickKeys(period): the key names the run's tick too (advlock.TickKey("gocron/job/"+name, the
//     scheduler's clock, period): the clock rounded to the nearest multiple of period), so ticks never share a
//     key and only S < h is needed (h at most a few periods: each held key costs a lock until its hold ends).
//     Schedulers whose clocks differ by half a period or more may name one run by two ticks, and run it twice.
//
// Beyond S the job may run twice for one tick, one run after the other (never at once). gocron does not tell a
// Locker the run's scheduled time, so the tick is read from the clock when the run starts. The hold ends early
// when the lock is lost (its session ended): another scheduler may then run the tick again. The Elector avoids
// all of this by letting one scheduler run every job.
type Locker struct {
	l      *advlock.Locker
	hold   time.Duration
	period time.Duration
	now    func() time.Time
}

var _ gocron.Locker = (*Locker)(nil)

// LockerOption configures a Locker.
type LockerOption func(*Locker)

// WithMinimumHold sets how long after its grant a run's key stays held at least (default 1 s; 0 holds it for
// the run only).
func WithMinimumHold(d time.Duration) LockerOption { return func(x *Locker) { x.hold = d } }

// WithTickKeys makes each run's key name its tick as well as its job: the clock rounded to the nearest multiple of
// period (the job's interval, or a second for a crontab with seconds, a minute for one without).
func WithTickKeys(period time.Duration) LockerOption { return func(x *Locker) { x.period = period } }

// WithClock sets the clock the tick is read from (default time.Now): give it the clock the scheduler was given
// (gocron.WithClock), as a test of skewed schedulers does.
func WithClock(now func() time.Time) LockerOption { return func(x *Locker) { x.now = now } }

// NewLocker returns a gocron.Locker over l.
func NewLocker(l *advlock.Locker, opts ...LockerOption) *Locker {
	x := &Locker{l: l, hold: time.Second, now: time.Now}
	for _, o := range opts {
		o(x)
	}
	return x
}

// Lock takes the run's key if no other scheduler holds it (else an error matching advlock.ErrNotAcquired, and
// gocron skips this run). The lock's Unlock, which gocron calls when the run ends, asks the server whether the lock
// is still held (one round trip; advlock ls then shows it held past its work) and returns; the key is released
// when the minimum hold has passed.
func (x *Locker) Lock(ctx context.Context, key string) (gocron.Lock, error) {
	k := advlock.TickKey("gocron/job/"+key, x.now(), x.period) // NameKey of the name alone without tick keys
	lk, err := x.l.TryLock(ctx, k, advlock.HoldAtLeast(x.hold))
	if err != nil {
		return nil, err
	}
	return lk, nil
}
