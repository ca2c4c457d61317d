package advlock

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
)

// Observer is told what a Locker's locks and sessions do, for logs, metrics and traces (WithLogger is one;
// contrib/otel provides OpenTelemetry metrics and traces over it). The Locker calls it synchronously on the
// goroutine where the event happens: methods must be quick, safe for concurrent use, and must not call the Locker.
type Observer interface {
	// LockStart is called when a lock call starts: TryLock, Lock, RLock, TryRLock, and those that Do, TryDo,
	// Lead and a Semaphore make. It returns the context for the call (it may carry a span) and a func that the
	// Locker calls once with the call's outcome.
	LockStart(ctx context.Context, c LockCall) (context.Context, func(LockOutcome))
	// LockEnd is called once when a lock that a call acquired ends: released by Unlock (or by Do), released by
	// Close, or lost.
	LockEnd(e LockEnd)
	// Session is called when a session opens, closes, or is destroyed on doubt.
	Session(e SessionEvent)
}

// CampaignObserver is an Observer that is also told when a [Locker.Lead] campaign fails (optional: the Locker
// asks each Observer whether it implements it). WithLogger's does.
type CampaignObserver interface {
	CampaignFailed(e CampaignFailure)
}

// CampaignFailure is a Lead campaign that failed.
type CampaignFailure struct {
	Key   Key
	Err   error
	Retry time.Duration // how long until the next campaign; 0 when Lead ended with Err
}

// LockCall describes a lock call.
type LockCall struct {
	Key    Key
	Shared bool
	Wait   bool // the call may wait for the key (Lock, RLock); false for tries
}

// Results of a lock call (LockOutcome.Result).
const (
	ResultAcquired    = "acquired"
	ResultNotAcquired = "not_acquired" // a try found the key held, or a Wait bound elapsed
	ResultCanceled    = "canceled"     // the call's context ended (canceled or its deadline passed)
	ResultError       = "error"
)

// LockOutcome is how a lock call ended.
type LockOutcome struct {
	Result string        // one of the Result constants
	Err    error         // nil when acquired
	Took   time.Duration // from the call to its outcome: for Lock and RLock, the wait
	Token  int64         // the fencing token when acquired with fencing
	PID    uint32        // when acquired: the server session (pg_backend_pid) that holds the lock; 0 when unknown
}

// Causes of a lock's end (LockEnd.Cause).
const (
	CauseReleased = "released" // Unlock (or Do, TryDo, Lead) released it
	CauseClosed   = "closed"   // Locker.Close released it
	CauseLost     = "lost"     // its session ended: terminated, timed out, network lost, server restarted
)

// LockEnd says how a held lock ended.
type LockEnd struct {
	Key     Key
	Shared  bool
	Session string // where it was held: "shared" (a shared session's), "dedicated" (a session of its own) or "lease" (WithLeases: a row, no session)
	PID     uint32 // the server session that held it (pg_backend_pid); 0 when unknown, and for a lease
	Token   int64  // its fencing token (0 without fencing)
	Held    time.Duration
	Cause   string // one of the Cause constants
	Err     error  // what Lock.Err reports (for a loss, why)
}

// SessionEvent is a session opening, closing, or being destroyed.
type SessionEvent struct {
	Event  string // "open", "close" (returned to the pool, or closed with the Locker), "destroy" (closed on doubt)
	Mode   string // "shared" (many locks on one session) or "dedicated" (a session of its own for one lock or wait)
	Reason string // why a session was destroyed
}

// WithObserver adds an Observer to the Locker; several may be added.
func WithObserver(o Observer) Option {
	return option(func(c *config.Options) {
		if o != nil {
			c.Observers = append(c.Observers, o)
		}
	})
}

// WithLogger logs through l: WARN when a held lock is lost (message "advlock: lock lost"; attributes key, as
// Key.String writes it, cause, and held, how long it had been held), when a session is destroyed on doubt
// (reason, mode), when a session lock is refused because a pooler in transaction mode stands in between, and when a
// Lead campaign fails and is tried again ("advlock: campaign failed; trying again": key, error, retry_in; ERROR
// "advlock: campaign ended" when Lead ends on an error), once per Lead call whose fn returns nil at once ("advlock:
// lead: fn returned at once; ...": key, took); DEBUG
// for every acquisition (result, wait), release (held) and session opened or closed. Errors it logs name no DSN
// and no password. A nil l logs nothing, as does a Locker without WithLogger.
func WithLogger(l *slog.Logger) Option {
	if l == nil {
		return option(func(*config.Options) {})
	}
	return WithObserver(logObserver{l})
}

type logObserver struct{ l *slog.Logger }

func (o logObserver) LockStart(ctx context.Context, c LockCall) (context.Context, func(LockOutcome)) {
	return ctx, func(r LockOutcome) {
		mode := modeName(c.Shared)
		switch {
		case r.Result == ResultError && errors.Is(r.Err, ErrTxPooling):
			o.l.LogAttrs(ctx, slog.LevelWarn, "advlock: lock refused: a pooler in transaction mode", slog.String("key", c.Key.String()),
				slog.String("mode", mode), slog.String("error", r.Err.Error()))
		case !o.l.Enabled(ctx, slog.LevelDebug):
		case r.Result == ResultAcquired:
			o.l.LogAttrs(ctx, slog.LevelDebug, "advlock: acquired", slog.String("key", c.Key.String()), slog.String("mode", mode),
				slog.Bool("wait", c.Wait), slog.Duration("took", r.Took), slog.Int64("token", r.Token))
		default:
			attrs := []slog.Attr{slog.String("key", c.Key.String()), slog.String("mode", mode), slog.Bool("wait", c.Wait),
				slog.String("result", r.Result), slog.Duration("took", r.Took)}
			if r.Err != nil && r.Result != ResultNotAcquired {
				attrs = append(attrs, slog.String("error", r.Err.Error()))
			}
			o.l.LogAttrs(ctx, slog.LevelDebug, "advlock: not acquired", attrs...)
		}
	}
}

func (o logObserver) LockEnd(e LockEnd) {
	ctx := context.Background()
	if e.Cause == CauseLost {
		cause := "unknown"
		if e.Err != nil {
			cause = strings.TrimPrefix(e.Err.Error(), ErrLockLost.Error()+": ") // the message says lost already
		}
		o.l.LogAttrs(ctx, slog.LevelWarn, "advlock: lock lost", slog.String("key", e.Key.String()),
			slog.String("mode", modeName(e.Shared)), slog.String("cause", cause), slog.Duration("held", e.Held))
		return
	}
	o.l.LogAttrs(ctx, slog.LevelDebug, "advlock: released", slog.String("key", e.Key.String()),
		slog.String("mode", modeName(e.Shared)), slog.String("by", e.Cause), slog.Duration("held", e.Held))
}

func (o logObserver) Session(e SessionEvent) {
	ctx := context.Background()
	if e.Event == "destroy" {
		o.l.LogAttrs(ctx, slog.LevelWarn, "advlock: session destroyed", slog.String("mode", e.Mode), slog.String("reason", e.Reason))
		return
	}
	o.l.LogAttrs(ctx, slog.LevelDebug, "advlock: session "+e.Event, slog.String("mode", e.Mode))
}

func (o logObserver) CampaignFailed(e CampaignFailure) {
	ctx := context.Background()
	if e.Retry == 0 {
		o.l.LogAttrs(ctx, slog.LevelError, "advlock: campaign ended", slog.String("key", e.Key.String()),
			slog.String("error", e.Err.Error()))
		return
	}
	o.l.LogAttrs(ctx, slog.LevelWarn, "advlock: campaign failed; trying again", slog.String("key", e.Key.String()),
		slog.String("error", e.Err.Error()), slog.Duration("retry_in", e.Retry))
}

func (o logObserver) nameNotPublished(key Key, err error) {
	o.l.LogAttrs(context.Background(), slog.LevelWarn, "advlock: lead: could not write the key's name to "+
		session.NamesTable+" (advlock ls shows the key as a number meanwhile); leading on",
		slog.String("key", key.String()), slog.String("error", err.Error()))
}

// nameObserver is an Observer told when Lead could not write its key's name (publishName): WithLogger's is.
type nameObserver interface {
	nameNotPublished(key Key, err error)
}

// nameNotPublished tells the observers that care that Lead could not write its key's name.
func (l *Locker) nameNotPublished(key Key, err error) {
	for _, o := range l.obs {
		if s, ok := o.(nameObserver); ok {
			s.nameNotPublished(key, err)
		}
	}
}

// shortTermObserver is an Observer told when a Lead's fn returned nil at once (see shortTerm): WithLogger's is.
type shortTermObserver interface {
	shortTerm(key Key, took time.Duration)
}

func (o logObserver) shortTerm(key Key, took time.Duration) {
	o.l.LogAttrs(context.Background(), slog.LevelWarn, "advlock: lead: fn returned at once; leadership lasts only "+
		"while fn runs, so fn should return only when its ctx ends; campaigning again after a backoff",
		slog.String("key", key.String()), slog.Duration("took", took))
}

// shortTerm tells the observers that care that a Lead's fn returned nil at once.
func (l *Locker) shortTerm(key Key, took time.Duration) {
	if l == nil {
		return
	}
	for _, o := range l.obs {
		if s, ok := o.(shortTermObserver); ok {
			s.shortTerm(key, took)
		}
	}
}

// campaignFailed counts a failed campaign and tells the observers that care.
func (l *Locker) campaignFailed(key Key, err error, retry time.Duration) {
	if l == nil {
		return
	}
	if retry > 0 {
		l.campaignRetries.Add(1)
	}
	for _, o := range l.obs {
		if c, ok := o.(CampaignObserver); ok {
			c.CampaignFailed(CampaignFailure{Key: key, Err: err, Retry: retry})
		}
	}
}

func modeName(shared bool) string {
	if shared {
		return "shared"
	}
	return "exclusive"
}

// observers returns the Locker's observers from its options.
func observers(o config.Options) []Observer {
	var out []Observer
	for _, x := range o.Observers {
		if ob, ok := x.(Observer); ok {
			out = append(out, ob)
		}
	}
	return out
}

// sessionEvents fans session events out to the observers.
func sessionEvents(obs []Observer) func(event, mode, reason string) {
	if len(obs) == 0 {
		return nil
	}
	return func(event, mode, reason string) {
		e := SessionEvent{Event: event, Mode: mode, Reason: reason}
		for _, o := range obs {
			o.Session(e)
		}
	}
}

// startCall tells the observers that a lock call starts; the returned func reports its outcome.
func (l *Locker) startCall(ctx context.Context, key Key, shared, wait bool) (context.Context, func(*Lock, error)) {
	if l == nil || len(l.obs) == 0 {
		return ctx, func(*Lock, error) {}
	}
	start := time.Now()
	c := LockCall{Key: key, Shared: shared, Wait: wait}
	ends := make([]func(LockOutcome), len(l.obs))
	for i, o := range l.obs {
		ctx, ends[i] = o.LockStart(ctx, c)
	}
	return ctx, func(lk *Lock, err error) {
		r := LockOutcome{Took: time.Since(start), Err: err}
		switch {
		case err == nil:
			r.Result, r.Token, r.PID = ResultAcquired, lk.Token(), lk.h.PID()
		case errors.Is(err, ErrNotAcquired):
			r.Result = ResultNotAcquired
		case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
			r.Result = ResultCanceled
		default:
			r.Result = ResultError
		}
		for i := len(ends) - 1; i >= 0; i-- {
			ends[i](r)
		}
	}
}

// granted starts watching lk for its end on behalf of the observers (once it is in the caller's hands).
func (l *Locker) granted(lk *Lock) {
	if len(l.obs) == 0 {
		return
	}
	lk.grantedAt = time.Since(clockStart)
	lk.observed.Store(true)
	l.mu.Lock()
	ended := lk.forgotten
	l.mu.Unlock()
	if ended { // it ended before we started watching: the end hook may have missed it
		<-lk.h.Done() // closes right after the slot is given back
		l.lockEnded(lk, lk.h.Err())
	}
}

// lockEnded reports lk's end to the observers, once, if its grant was reported.
func (l *Locker) lockEnded(lk *Lock, err error) {
	if !lk.observed.CompareAndSwap(true, false) {
		return
	}
	e := LockEnd{Key: lk.key, Shared: lk.shared, Session: "dedicated", PID: lk.h.PID(), Token: lk.Token(),
		Held: time.Since(clockStart) - lk.grantedAt, Err: err}
	switch lk.h.(type) {
	case *session.Held:
		e.Session = "shared"
	case *lease.Lease:
		e.Session = "lease"
	}
	switch {
	case errors.Is(e.Err, ErrLockLost):
		e.Cause = CauseLost
	case errors.Is(e.Err, ErrClosed):
		e.Cause = CauseClosed
	default:
		e.Cause = CauseReleased
	}
	for _, o := range l.obs {
		o.LockEnd(e)
	}
}
