package advlockotel_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/advlock/advlock"
	advlockotel "github.com/advlock/advlock/contrib/otel"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// sums returns a Sum metric's data points as attribute set -> value.
func sums(t *testing.T, rm metricdata.ResourceMetrics, name string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			s, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				t.Fatalf("%s is %T, want an int64 sum", name, m.Data)
			}
			for _, dp := range s.DataPoints {
				out[dp.Attributes.Encoded(attribute.DefaultEncoder())] += dp.Value
			}
		}
	}
	return out
}

func histCount(t *testing.T, rm metricdata.ResourceMetrics, name string) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			if m.Unit != "s" {
				t.Errorf("%s unit %q, want s", name, m.Unit)
			}
			h, ok := m.Data.(metricdata.Histogram[float64])
			if !ok {
				t.Fatalf("%s is %T, want a float64 histogram", name, m.Data)
			}
			for _, dp := range h.DataPoints {
				out[dp.Attributes.Encoded(attribute.DefaultEncoder())] += dp.Count
			}
		}
	}
	return out
}

// Every metric moves with what the Locker does, the gauges return to zero when it closes, and each waiting call
// has a span with its result (tries have none).
func TestMetricsAndSpans(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	spans := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(spans))
	url := pgtest.URL(t)
	l, err := advlock.Open(ctx, url, advlockotel.WithMeterProvider(mp), advlockotel.WithTracerProvider(tp))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	other, err := advlock.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	obs := pgtest.Conn(t, url)
	k := advlock.Int64Key(time.Now().UnixNano())

	lk, err := l.Lock(ctx, k) // acquired (waiting call: a span)
	if err != nil {
		t.Fatal(err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	held, err := other.Lock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.TryLock(ctx, k); !errors.Is(err, advlock.ErrNotAcquired) { // not_acquired, no span
		t.Fatal(err)
	}
	cctx, ccancel := context.WithTimeout(ctx, 100*time.Millisecond)
	if _, err := l.Lock(cctx, k); err == nil { // canceled
		t.Fatal("Lock of a held key succeeded")
	}
	ccancel()
	if _, err := l.TryLock(ctx, advlock.Key{}); err == nil { // error
		t.Fatal("zero key accepted")
	}
	if err := held.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	lk, err = l.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgtest.Holders(ctx, obs, mustInt(k))
	if err != nil || len(pids) != 1 {
		t.Fatalf("holders %v, %v", pids, err)
	}
	pgtest.Terminate(t, obs, pids[0]) // lost
	pgtest.WaitClosed(t, lk.Done(), 10*time.Second, "lost lock")

	// The loss is reported to observers just after Done closes, and the shared session's end just after that.
	var rm metricdata.ResourceMetrics
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		rm = metricdata.ResourceMetrics{}
		if err := reader.Collect(ctx, &rm); err != nil {
			t.Fatal(err)
		}
		if sums(t, rm, "advlock.lock.losses")["cause=terminated"] == 1 && len(sums(t, rm, "advlock.sessions.destroyed")) > 0 ||
			time.Now().After(deadline) {
			break
		}
	}
	acq := sums(t, rm, "advlock.lock.acquisitions")
	t.Logf("acquisitions %v", acq)
	for _, want := range []string{"result=acquired,wait=true", "result=acquired,wait=false", "result=not_acquired,wait=false",
		"result=canceled,wait=true", "result=error,wait=false"} {
		if acq[want] == 0 {
			t.Errorf("advlock.lock.acquisitions has no %s", want)
		}
	}
	if h := histCount(t, rm, "advlock.lock.wait.duration"); h["result=acquired"] != 1 || h["result=canceled"] != 1 {
		t.Errorf("advlock.lock.wait.duration counts %v, want one acquired and one canceled", h)
	}
	if h := histCount(t, rm, "advlock.lock.hold.duration"); h["cause=released"] != 1 || h["cause=lost"] != 1 {
		t.Errorf("advlock.lock.hold.duration counts %v, want one released and one lost", h)
	}
	if s := sums(t, rm, "advlock.lock.losses"); s["cause=terminated"] != 1 {
		t.Errorf("advlock.lock.losses %v, want cause=terminated 1", s)
	}
	if s := sums(t, rm, "advlock.locks.held"); s[""] != 0 {
		t.Errorf("advlock.locks.held %v, want 0 once both locks ended", s)
	}
	if s := sums(t, rm, "advlock.sessions.destroyed"); s["mode=shared,reason=shared session lost"] != 1 {
		t.Errorf("advlock.sessions.destroyed %v, want the terminated shared session", s)
	}
	if s := sums(t, rm, "advlock.sessions.open"); s["mode=shared"] < 0 || s["mode=dedicated"] != 0 {
		t.Errorf("advlock.sessions.open %v", s)
	}

	l.Close()
	rm = metricdata.ResourceMetrics{}
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	if s := sums(t, rm, "advlock.sessions.open"); s["mode=shared"] != 0 || s["mode=dedicated"] != 0 {
		t.Errorf("advlock.sessions.open after Close %v, want 0", s)
	}

	got := map[string]int{}
	for _, s := range spans.GetSpans() {
		if s.Name != "advlock.lock" {
			t.Errorf("span %q", s.Name)
		}
		for _, a := range s.Attributes {
			if a.Key == "advlock.result" {
				got[a.Value.AsString()]++
			}
		}
	}
	if len(spans.GetSpans()) != 2 || got["acquired"] != 1 || got["canceled"] != 1 {
		t.Errorf("spans by result %v (%d spans), want one acquired and one canceled Lock, none for tries", got, len(spans.GetSpans()))
	}
}

func mustInt(k advlock.Key) int64 {
	v, _ := k.Int64()
	return v
}
