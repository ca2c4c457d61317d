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
// or, job by job: gocron.WithDistributedLocker(advlockgocron.NewLocker(locks)).
package advlockgocron

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

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

// Locker is a gocron.Locker: each run of a job takes the key NameKey("gocron/job/"+name) without waiting, so that
// when several schedulers start the same job at once only one runs it (the others skip that run); the lock is held
// for the run. gocron notes that schedulers whose clocks differ may still run a job one after another; the
// Elector avoids that.
type Locker struct {
	l *advlock.Locker
}

var _ gocron.Locker = (*Locker)(nil)

// NewLocker returns a gocron.Locker over l.
func NewLocker(l *advlock.Locker) *Locker { return &Locker{l: l} }

// Lock takes the job's key if no other scheduler holds it (else an error matching advlock.ErrNotAcquired, and
// gocron skips this run).
func (x *Locker) Lock(ctx context.Context, key string) (gocron.Lock, error) {
	lk, err := x.l.TryLock(ctx, advlock.NameKey("gocron/job/"+key))
	if err != nil {
		return nil, err
	}
	return lk, nil
}
