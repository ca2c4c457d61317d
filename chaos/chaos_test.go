package main

import (
	"context"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if raw := os.Getenv(envWorker); raw != "" { // this test binary re-executed as a worker
		os.Exit(runWorker(raw))
	}
	goleak.VerifyTestMain(m)
}

// TestCampaign is the bounded campaign: a fixed seed, every fault kind, and the checker must find nothing.
func TestCampaign(t *testing.T) {
	if testing.Short() {
		t.Skip("the campaign starts a private cluster and runs for a minute (-short)")
	}
	d := time.Minute
	if v := os.Getenv("ADVLOCK_CHAOS_DURATION"); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil {
			t.Fatal(err)
		}
	}
	r, err := Run(context.Background(), Options{Duration: d, Seed: 1, Workers: 6, Log: testLog{t}})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	r.Print(&b)
	t.Log("\n" + b.String())
	if !r.OK() {
		t.Fatalf("%d violations, %d leaked locks, not exercised: %v", r.Violations, r.LeakedLocks, r.NotExercised)
	}
	if r.Grants < 1000 {
		t.Errorf("only %d grants: the campaign did not exercise the locks", r.Grants)
	}
	for _, k := range append(faultKinds, "cancel") {
		if r.Faults[k] < 2 {
			t.Errorf("fault %s injected %d times, want at least 2", k, r.Faults[k])
		}
	}
	if r.LossesTold == 0 || r.Refused == 0 {
		t.Errorf("losses told %d, refused writes %d: the faults did not reach the holders", r.LossesTold, r.Refused)
	}
}

// TestCampaignBrokenLocker runs the campaign with the classic wrong locker (lock and unlock on any pooled
// connection, unlock's result ignored): the checker must report overlaps and leaked locks.
func TestCampaignBrokenLocker(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster (-short)")
	}
	r, err := Run(context.Background(), Options{Duration: 8 * time.Second, Seed: 2, Workers: 2, Broken: true, NoFaults: true})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	r.Print(&b)
	t.Log("\n" + b.String())
	if r.OK() {
		t.Fatal("the checker found nothing wrong with a locker that pools held locks")
	}
	os.RemoveAll(r.Dir) // kept because something was found; here that was the point
	for _, k := range []string{VOverlap, VLeak} {
		if r.ViolationsByKind[k] == 0 {
			t.Errorf("no %s violation reported", k)
		}
	}
}

// A run under faults too short for every kind of fault to take effect proves less than it seems: it fails as not
// exercised, with no violation found.
func TestCampaignNotExercised(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private cluster (-short)")
	}
	r, err := Run(context.Background(), Options{Duration: 2 * time.Second, Seed: 3, Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(r.Dir)
	if r.OK() || len(r.NotExercised) == 0 {
		t.Fatalf("a 2-second run under faults passed: not exercised %v", r.NotExercised)
	}
	t.Logf("not exercised: %v", r.NotExercised)
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

var t0 = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

func yes() *bool { b := true; return &b }
func no() *bool  { b := false; return &b }

// history builds a history from critical sections given as (id, worker, mode, token, clean, told ms or -1,
// write times ms).
type csSpec struct {
	id     string
	worker int
	mode   string
	token  int64
	clean  bool
	told   int
	writes []int
	refuse []bool
}

func build(specs ...csSpec) *History {
	h := &History{CS: map[string]*CS{}, Bound: time.Second, AppName: func(w int) string { return "w" + string(rune('0'+w)) }}
	id := int64(0)
	for _, s := range specs {
		c := &CS{ID: s.id, Worker: s.worker, Op: "lock", Key: "k", Mode: s.mode, Token: s.token, Ended: true, Clean: s.clean}
		if s.told >= 0 {
			c.Told = at(s.told)
		}
		h.CS[s.id] = c
		for i, ms := range s.writes {
			id++
			acc := yes()
			if s.mode == "s" {
				acc = nil
			} else if i < len(s.refuse) && s.refuse[i] {
				acc = no()
			}
			h.Writes = append(h.Writes, Write{Key: "k", Token: s.token, CS: s.id, Worker: s.worker, Mode: s.mode, Accepted: acc, At: at(ms)})
		}
	}
	sort.SliceStable(h.Writes, func(i, j int) bool { return h.Writes[i].At.Before(h.Writes[j].At) })
	for i := range h.Writes {
		id++
		h.Writes[i].ID = id // the ledger's ids follow the server's order
	}
	return h
}

func kinds(vs []Violation) map[string]int {
	m := map[string]int{}
	for _, v := range vs {
		m[v.Kind]++
	}
	return m
}

// TestChecker feeds the checker histories with and without each violation kind.
func TestChecker(t *testing.T) {
	cases := []struct {
		name string
		h    *History
		want map[string]int
	}{
		{"sequential holders", build(
			csSpec{"a", 0, "x", 1, true, -1, []int{0, 10, 20}, nil},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, nil}), map[string]int{}},
		{"clean holder overlapped", build(
			csSpec{"a", 0, "x", 1, true, -1, []int{0, 50}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, nil}), map[string]int{VOverlap: 1, VTokenOrder: 1}},
		{"lost holder within the bound", build(
			csSpec{"a", 0, "x", 1, false, 500, []int{0, 400}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, []bool{false, false}}), map[string]int{}},
		{"lost holder told too late", build(
			csSpec{"a", 0, "x", 1, false, 3000, []int{0, 2500}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, false, -1, []int{30, 40}, nil}), map[string]int{VOverlap: 1}},
		{"a lost holder granted first writes once after the next one began", build( // seen in a campaign
			csSpec{"new", 3, "x", 2618, true, -1, []int{0, 43}, nil},
			csSpec{"old", 1, "x", 2498, false, 41, []int{40}, []bool{true}}), map[string]int{}},
		{"writes after being told do not count", build(
			csSpec{"a", 0, "x", 1, false, 20, []int{0, 2500}, nil},
			csSpec{"b", 1, "x", 2, false, -1, []int{30, 40}, nil}), map[string]int{VStaleToken: 1}},
		{"shared holders together", build(
			csSpec{"a", 0, "s", 1, true, -1, []int{0, 50}, nil},
			csSpec{"b", 1, "s", 2, true, -1, []int{30, 40}, nil}), map[string]int{}},
		{"shared and exclusive together", build(
			csSpec{"a", 0, "s", 1, true, -1, []int{0, 50}, nil},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, nil}), map[string]int{VOverlap: 1}},
		{"stale token accepted", build(
			csSpec{"a", 0, "x", 5, false, -1, []int{0, 10}, nil},
			csSpec{"b", 1, "x", 3, false, -1, []int{20, 30}, nil}), map[string]int{VStaleToken: 2}},
		{"one token, two grants", build(
			csSpec{"a", 0, "x", 0, true, -1, []int{0, 10}, nil},
			csSpec{"b", 1, "x", 0, true, -1, []int{20, 30}, nil}), map[string]int{VStaleToken: 1, VTokenOrder: 1}},
		{"later grant, smaller token, refused", build(
			csSpec{"a", 0, "x", 5, true, -1, []int{0, 10}, nil},
			csSpec{"b", 1, "x", 3, true, -1, []int{20, 30}, []bool{true, true}}), map[string]int{VTokenOrder: 2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := kinds(Check(tc.h))
			if len(got) != len(tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			for k, n := range tc.want {
				if got[k] != n {
					t.Fatalf("got %v, want %v", got, tc.want)
				}
			}
		})
	}

	t.Run("phantom", func(t *testing.T) {
		h := build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 100, 200}, nil})
		h.Samples = []Sample{{At: at(150), Held: map[string][]Holder{"k": {{App: "w0", Granted: true}}}}}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("held as pg_locks shows: got %v", got)
		}
		h = build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 100, 200}, nil})
		h.Samples = []Sample{{At: at(150), Held: map[string][]Holder{"k": {{App: "w1", Granted: true}}}}}
		if got := kinds(Check(h)); got[VPhantom] != 1 {
			t.Fatalf("another holder in pg_locks: got %v", got)
		}
	})
	t.Run("paused holder is judged by the fence", func(t *testing.T) {
		h := build(
			csSpec{"a", 0, "x", 1, false, 4000, []int{0, 3000}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, false, -1, []int{30, 40}, nil})
		h.Pauses = []Pause{{Worker: 0, From: at(10), To: at(2900)}}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("paused holder refused: got %v", got)
		}
		h = build(
			csSpec{"a", 0, "x", 1, false, 4000, []int{0, 3000}, nil},
			csSpec{"b", 1, "x", 2, false, -1, []int{30, 40}, nil})
		h.Pauses = []Pause{{Worker: 0, From: at(10), To: at(2900)}}
		if got := kinds(Check(h)); got[VStaleToken] != 1 || got[VOverlap] != 0 {
			t.Fatalf("paused holder accepted after a newer token: got %v", got)
		}
	})
	t.Run("semaphore", func(t *testing.T) {
		h := build(
			csSpec{"a", 0, "x", 1, true, -1, []int{0, 100}, nil},
			csSpec{"b", 1, "x", 2, true, -1, []int{10, 110}, nil},
			csSpec{"c", 2, "x", 3, true, -1, []int{20, 120}, nil})
		for _, c := range h.CS {
			c.Key, c.Op = "slot"+c.ID, "semaphore"
		}
		for i := range h.Writes {
			h.Writes[i].Key = "slot" + h.Writes[i].CS
		}
		h.SemKeys = map[string]bool{"slota": true, "slotb": true, "slotc": true}
		h.SemN = 3
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("3 of 3: got %v", got)
		}
		h.SemN = 2
		if got := kinds(Check(h)); got[VSemaphore] != 1 {
			t.Fatalf("3 of 2: got %v", got)
		}
		// A holder of a slot the semaphore does not have (slot n or above), by operation, whatever the count.
		h.SemKeys = map[string]bool{"slota": true, "slotb": true}
		if got := kinds(Check(h)); got[VSemaphore] != 1 {
			t.Fatalf("a third slot of 2: got %v", got)
		}
		h.CS["c"].Op = "lock" // the same key held by a plain lock is no semaphore holder
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("2 slots and a plain lock: got %v", got)
		}
	})
	t.Run("leaks and worker problems", func(t *testing.T) {
		h := build()
		h.Leaked = []string{"k held by w0"}
		h.Problems = []Violation{{VPanic, "panic: x"}, {VHang, "lock"}, {VGoroutines, "goroutine 7"}, {VDied, "exit status 2"}}
		if got := kinds(Check(h)); got[VLeak] != 1 || got[VPanic] != 1 || got[VHang] != 1 || got[VGoroutines] != 1 || got[VDied] != 1 {
			t.Fatalf("got %v", got)
		}
	})
}
