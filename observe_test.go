package advlock

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/testkit/pgtest"
)

// logRecords parses a JSON slog stream.
func logRecords(t *testing.T, buf *syncBuffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		out = append(out, m)
	}
	return out
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func findRecord(recs []map[string]any, level, msg string) map[string]any {
	for _, r := range recs {
		if r["level"] == level && r["msg"] == msg {
			return r
		}
	}
	return nil
}

// WithLogger: a lost lock is a WARN naming the key as Key.String writes it, the cause and how long it was held; the
// destroyed session is a WARN with its reason; acquisitions and releases are DEBUG with durations; nothing names
// the DSN's password.
func TestLogger(t *testing.T) {
	for _, mode := range []struct {
		name   string
		shared int
	}{{"shared", 4}, {"dedicated", 0}} {
		t.Run(mode.name, func(t *testing.T) {
			var buf syncBuffer
			log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
			u, err := url.Parse(pgtest.URL(t))
			if err != nil {
				t.Fatal(err)
			}
			u.User = url.UserPassword(u.User.Username(), "sekret-pw") // trust auth: accepted and ignored
			l, err := Open(ctxT(t, 10*time.Second), u.String(), WithLogger(log), WithSharedSessions(mode.shared))
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			b := &bundle{obs: pgtest.Conn(t, pgtest.URL(t))}
			ctx := ctxT(t, 20*time.Second)
			k := PairKey(4242, int32(time.Now().UnixNano()%1000000))
			lk, err := l.TryLock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			if err := lk.Unlock(ctx); err != nil {
				t.Fatal(err)
			}
			k2 := key(t)
			lk, err = l.Lock(ctx, k2)
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(20 * time.Millisecond)
			pgtest.Terminate(t, b.obs, b.pidOf(t, lk))
			waitDone(t, lk, 10*time.Second)
			l.Close()

			recs := logRecords(t, &buf)
			acq := findRecord(recs, "DEBUG", "advlock: acquired")
			if acq == nil || acq["key"] != k.String() || acq["took"] == nil {
				t.Errorf("no DEBUG acquired record for %s with its duration: %v", k, acq)
			}
			if rel := findRecord(recs, "DEBUG", "advlock: released"); rel == nil || rel["held"] == nil || rel["by"] != "released" {
				t.Errorf("no DEBUG released record with held: %v", rel)
			}
			lost := findRecord(recs, "WARN", "advlock: lock lost")
			if lost == nil {
				t.Fatalf("no WARN for the lost lock; records: %v", recs)
			}
			if lost["key"] != k2.String() || !strings.Contains(lost["cause"].(string), "57P01") || lost["held"] == nil {
				t.Errorf("lost record = %v, want key %s, cause with 57P01, held", lost, k2)
			}
			d := findRecord(recs, "WARN", "advlock: session destroyed")
			if d == nil || !strings.Contains(d["reason"].(string), "57P01") || d["mode"] != mode.name {
				t.Errorf("destroyed record = %v, want reason with 57P01 and mode %s", d, mode.name)
			}
			if strings.Contains(buf.String(), "sekret") {
				t.Errorf("the log names the password:\n%s", buf.String())
			}
			t.Logf("lost: %v\ndestroyed: %v", lost, d)
		})
	}
	t.Run("nil logs nothing", func(t *testing.T) {
		b := setup(t, WithLogger(nil))
		lk, err := b.l.TryLock(ctxT(t, 10*time.Second), key(t))
		if err != nil {
			t.Fatal(err)
		}
		_ = lk.Unlock(ctxT(t, 10*time.Second))
		if len(b.l.obs) != 0 {
			t.Errorf("a nil logger added %d observers", len(b.l.obs))
		}
	})
}

// A session lock refused behind transaction pooling is a WARN.
func TestLoggerTxPooling(t *testing.T) {
	var buf syncBuffer
	log := slog.New(slog.NewJSONHandler(&buf, nil))
	url := pgtest.Bouncer(t, pgtest.URL(t), "transaction")
	l := New(pgtest.Pool(t, url, nil), WithLogger(log))
	defer l.Close()
	if _, err := l.TryLock(ctxT(t, 10*time.Second), key(t)); !errors.Is(err, ErrTxPooling) {
		t.Fatalf("TryLock through transaction pooling: %v", err)
	}
	if r := findRecord(logRecords(t, &buf), "WARN", "advlock: lock refused: a pooler in transaction mode"); r == nil {
		t.Fatalf("no WARN; log:\n%s", buf.String())
	}
}

// recorder is an Observer that keeps everything.
type recorder struct {
	mu       sync.Mutex
	outcomes map[string]int
	ends     map[string]int
	sessions map[string]int // event/mode
	reasons  []string
	lastPID  uint32 // of the last grant
	endPIDs  map[uint32]int
}

type ctxMark struct{}

func newRecorder() *recorder {
	return &recorder{outcomes: map[string]int{}, ends: map[string]int{}, sessions: map[string]int{}, endPIDs: map[uint32]int{}}
}

func (r *recorder) LockStart(ctx context.Context, c LockCall) (context.Context, func(LockOutcome)) {
	ctx = context.WithValue(ctx, ctxMark{}, c.Key)
	return ctx, func(o LockOutcome) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.outcomes[o.Result]++
		if o.Result == ResultAcquired {
			r.lastPID = o.PID
		}
		if (o.Result == ResultAcquired) != (o.Err == nil) || o.Took <= 0 {
			r.outcomes["inconsistent"]++
		}
	}
}

func (r *recorder) LockEnd(e LockEnd) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ends[e.Cause]++
	r.ends["session "+e.Session]++
	r.endPIDs[e.PID]++
	if e.Held <= 0 {
		r.ends["no held time"]++
	}
}

func (r *recorder) Session(e SessionEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sessions[e.Event+"/"+e.Mode]++
	if e.Event == "destroy" {
		r.reasons = append(r.reasons, e.Reason)
	}
}

// The observer hook sees every outcome kind, every way a lock ends, and sessions opening and ending in balance:
// after Close, every session it saw open was closed or destroyed, and every grant it saw ended.
func TestObserver(t *testing.T) {
	for _, mode := range []struct {
		name   string
		shared int
	}{{"shared", 4}, {"dedicated", 0}} {
		t.Run(mode.name, func(t *testing.T) {
			rec := newRecorder()
			b := setup(t, WithObserver(rec), WithSharedSessions(mode.shared))
			l := b.l
			ctx := ctxT(t, 30*time.Second)
			k := key(t)
			lk, err := l.Lock(ctx, k) // acquired
			if err != nil {
				t.Fatal(err)
			}
			other := New(b.pool)
			defer other.Close()
			if _, err := other.TryLock(ctx, k); !errors.Is(err, ErrNotAcquired) { // held elsewhere
				t.Fatal(err)
			}
			if _, err := l.TryLock(ctx, k); !errors.Is(err, ErrNotAcquired) { // not_acquired (in-process)
				t.Fatal(err)
			}
			cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
			other2 := New(b.pool, WithObserver(rec), WithSharedSessions(mode.shared))
			if _, err := other2.Lock(cctx, k); err == nil { // canceled
				t.Fatal("Lock of a held key succeeded")
			}
			cancel()
			other2.Close()
			if err := lk.Unlock(ctx); err != nil { // released
				t.Fatal(err)
			}
			lk, err = l.TryLock(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			pid := b.pidOf(t, lk)
			rec.mu.Lock()
			if rec.lastPID != pid { // the grant names the server session pg_locks shows holding the key
				t.Errorf("LockOutcome.PID %d, pg_locks shows pid %d holding the key", rec.lastPID, pid)
			}
			rec.mu.Unlock()
			pgtest.Terminate(t, b.obs, pid) // lost
			waitDone(t, lk, 10*time.Second)
			if _, err := l.TryLock(ctx, Key{}); err == nil { // error (invalid key)
				t.Fatal("zero key accepted")
			}
			if _, err := l.Lock(ctx, key(t)); err != nil { // closed
				t.Fatal(err)
			}
			l.Close()

			rec.mu.Lock()
			defer rec.mu.Unlock()
			t.Logf("outcomes %v, ends %v, sessions %v, reasons %q", rec.outcomes, rec.ends, rec.sessions, rec.reasons)
			for _, r := range []string{ResultAcquired, ResultNotAcquired, ResultCanceled, ResultError} {
				if rec.outcomes[r] == 0 {
					t.Errorf("no %s outcome", r)
				}
			}
			if rec.outcomes["inconsistent"] > 0 {
				t.Error("an outcome with an error that does not match its result, or no duration")
			}
			for _, c := range []string{CauseReleased, CauseLost, CauseClosed} {
				if rec.ends[c] == 0 {
					t.Errorf("no lock end with cause %s", c)
				}
			}
			if rec.ends["no held time"] > 0 {
				t.Error("a lock end without a held time")
			}
			if got, want := rec.ends[CauseReleased]+rec.ends[CauseLost]+rec.ends[CauseClosed], rec.outcomes[ResultAcquired]; got != want {
				t.Errorf("%d lock ends for %d acquisitions", got, want)
			}
			m := "shared"
			if mode.shared == 0 {
				m = "dedicated"
			}
			// Each lock end says where the lock was held: every one of them on a shared session with shared
			// sessions (the keys were free: each grant came at once), none without.
			if rec.ends["session "+m] != rec.outcomes[ResultAcquired] {
				t.Errorf("lock ends %v: want all %d on %s sessions", rec.ends, rec.outcomes[ResultAcquired], m)
			}
			opened := rec.sessions["open/"+m]
			if opened == 0 || rec.sessions["destroy/"+m] == 0 {
				t.Errorf("sessions %v: want %s sessions opened and one destroyed (the terminated one)", rec.sessions, m)
			}
			if ended := rec.sessions["close/"+m] + rec.sessions["destroy/"+m]; ended != opened {
				t.Errorf("%d %s sessions opened, %d ended", opened, m, ended)
			}
			if rec.endPIDs[0] > 0 {
				t.Errorf("a lock end without the pid of its session: %v", rec.endPIDs)
			}
			if !strings.Contains(strings.Join(rec.reasons, "\n"), "57P01") {
				t.Errorf("no destroy reason names the termination: %q", rec.reasons)
			}
		})
	}
}
