// Package advlockotel reports what an advlock Locker does as OpenTelemetry metrics and traces. It is a module of
// its own, so that the advlock module depends on pgx alone.
//
//	l, err := advlock.Open(ctx, dsn,
//		advlockotel.WithMeterProvider(otel.GetMeterProvider()),
//		advlockotel.WithTracerProvider(otel.GetTracerProvider()))
//
// Metrics (instrument names follow the OpenTelemetry naming rules: dot-separated namespaces, units in UCUM):
//
//   - advlock.lock.acquisitions (counter, {acquisition}; attribute result: acquired, not_acquired, error,
//     canceled; wait: whether the call could wait)
//   - advlock.lock.wait.duration (histogram, s; calls that may wait, Lock and RLock; attribute result)
//   - advlock.lock.hold.duration (histogram, s; attribute cause: released, closed, lost)
//   - advlock.lock.losses (counter, {loss}; attribute cause: terminated, idle_timeout, server_shutdown,
//     keepalive, unlock, session_ended)
//   - advlock.locks.held (up-down counter, {lock})
//   - advlock.sessions.destroyed (counter, {session}; attribute reason: what was going on when the session was
//     closed on doubt, such as "lock lost" or "unlock not confirmed"; mode)
//   - advlock.sessions.open (up-down counter, {session}; attribute mode: shared or dedicated)
//
// Traces: a span "advlock.lock" for each call that may wait (Lock, RLock, and those Do, Lead and a semaphore
// make), with the key, mode and result, ending when the call returns. Tries (TryLock, TryDo) get no span: they
// make one round trip and would drown the trace; their outcomes are in advlock.lock.acquisitions.
package advlockotel

import (
	"context"
	"errors"
	"strings"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Scope is the instrumentation scope name of the meter and the tracer.
const Scope = "github.com/advlock/advlock/contrib/otel"

// WithMeterProvider records the Locker's metrics with a meter from mp.
func WithMeterProvider(mp metric.MeterProvider) advlock.Option {
	m := mp.Meter(Scope)
	o := &meters{}
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	var err error
	o.acquisitions, err = m.Int64Counter("advlock.lock.acquisitions", metric.WithUnit("{acquisition}"),
		metric.WithDescription("Lock calls by result"))
	add(err)
	o.wait, err = m.Float64Histogram("advlock.lock.wait.duration", metric.WithUnit("s"),
		metric.WithDescription("How long calls that may wait (Lock, RLock) took to their outcome"))
	add(err)
	o.hold, err = m.Float64Histogram("advlock.lock.hold.duration", metric.WithUnit("s"),
		metric.WithDescription("How long locks were held, by how they ended"))
	add(err)
	o.losses, err = m.Int64Counter("advlock.lock.losses", metric.WithUnit("{loss}"),
		metric.WithDescription("Held locks lost, by cause"))
	add(err)
	o.held, err = m.Int64UpDownCounter("advlock.locks.held", metric.WithUnit("{lock}"),
		metric.WithDescription("Locks held now"))
	add(err)
	o.destroyed, err = m.Int64Counter("advlock.sessions.destroyed", metric.WithUnit("{session}"),
		metric.WithDescription("Sessions closed on doubt instead of returned to the pool, by reason"))
	add(err)
	o.open, err = m.Int64UpDownCounter("advlock.sessions.open", metric.WithUnit("{session}"),
		metric.WithDescription("Sessions advlock holds now, by mode"))
	add(err)
	if len(errs) > 0 {
		otel.Handle(errors.Join(errs...)) // the API handed out no-op instruments in their place
	}
	return advlock.WithObserver(o)
}

// WithTracerProvider makes a span for each lock call that may wait, with a tracer from tp.
func WithTracerProvider(tp trace.TracerProvider) advlock.Option {
	return advlock.WithObserver(&tracer{t: tp.Tracer(Scope)})
}

type meters struct {
	acquisitions metric.Int64Counter
	wait, hold   metric.Float64Histogram
	losses       metric.Int64Counter
	held         metric.Int64UpDownCounter
	destroyed    metric.Int64Counter
	open         metric.Int64UpDownCounter
}

func (o *meters) LockStart(ctx context.Context, c advlock.LockCall) (context.Context, func(advlock.LockOutcome)) {
	return ctx, func(r advlock.LockOutcome) {
		res := attribute.String("result", r.Result)
		if o.acquisitions != nil {
			o.acquisitions.Add(ctx, 1, metric.WithAttributes(res, attribute.Bool("wait", c.Wait)))
		}
		if c.Wait && o.wait != nil {
			o.wait.Record(ctx, r.Took.Seconds(), metric.WithAttributes(res))
		}
		if r.Result == advlock.ResultAcquired && o.held != nil {
			o.held.Add(ctx, 1)
		}
	}
}

func (o *meters) LockEnd(e advlock.LockEnd) {
	ctx := context.Background()
	if o.hold != nil {
		o.hold.Record(ctx, e.Held.Seconds(), metric.WithAttributes(attribute.String("cause", e.Cause)))
	}
	if o.held != nil {
		o.held.Add(ctx, -1)
	}
	if e.Cause == advlock.CauseLost && o.losses != nil {
		o.losses.Add(ctx, 1, metric.WithAttributes(attribute.String("cause", LossCause(e.Err))))
	}
}

func (o *meters) Session(e advlock.SessionEvent) {
	ctx := context.Background()
	mode := attribute.String("mode", e.Mode)
	switch e.Event {
	case "open":
		if o.open != nil {
			o.open.Add(ctx, 1, metric.WithAttributes(mode))
		}
	case "close", "destroy":
		if o.open != nil {
			o.open.Add(ctx, -1, metric.WithAttributes(mode))
		}
		if e.Event == "destroy" && o.destroyed != nil {
			o.destroyed.Add(ctx, 1, metric.WithAttributes(attribute.String("reason", ReasonClass(e.Reason)), mode))
		}
	}
}

// LossCause names why a lock was lost, from its error, in a few words fit for a metric attribute.
func LossCause(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		switch pg.Code {
		case "57P01":
			return "terminated"
		case "57P05":
			return "idle_timeout"
		case "57P02", "57P03":
			return "server_shutdown"
		}
	}
	switch {
	case err == nil:
		return "unknown"
	case strings.Contains(err.Error(), "keepalive"):
		return "keepalive"
	case strings.Contains(err.Error(), "pg_advisory_unlock returned false"):
		return "unlock"
	case strings.Contains(err.Error(), "shutdown") || strings.Contains(err.Error(), "57P02"):
		return "server_shutdown"
	}
	return "session_ended"
}

// ReasonClass is the part of a destroyed session's reason before the first colon (what was going on), without
// the error's text, so that the attribute keeps a small set of values.
func ReasonClass(reason string) string {
	if i := strings.Index(reason, ":"); i >= 0 {
		reason = reason[:i]
	}
	return reason
}

type tracer struct{ t trace.Tracer }

func (o *tracer) LockStart(ctx context.Context, c advlock.LockCall) (context.Context, func(advlock.LockOutcome)) {
	if !c.Wait {
		return ctx, func(advlock.LockOutcome) {}
	}
	mode := "exclusive"
	if c.Shared {
		mode = "shared"
	}
	ctx, span := o.t.Start(ctx, "advlock.lock", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("advlock.key", c.Key.String()), attribute.String("advlock.mode", mode),
			attribute.String("db.system.name", "postgresql")))
	return ctx, func(r advlock.LockOutcome) {
		span.SetAttributes(attribute.String("advlock.result", r.Result))
		if r.Token != 0 {
			span.SetAttributes(attribute.Int64("advlock.token", r.Token))
		}
		if r.Result == advlock.ResultError {
			span.RecordError(r.Err)
			span.SetStatus(codes.Error, r.Err.Error())
		}
		span.End()
	}
}

func (o *tracer) LockEnd(advlock.LockEnd)      {}
func (o *tracer) Session(advlock.SessionEvent) {}
