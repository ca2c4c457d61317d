package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock"
)

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
		{"twenty sequential holders", build(func() []csSpec { // in whatever order the map gives them
			var out []csSpec
			for i := range 20 {
				out = append(out, csSpec{string(rune('a' + i)), i % 3, "x", int64(i + 1), true, -1, []int{100 * i, 100*i + 50}, nil})
			}
			return out
		}()...), map[string]int{}},
		{"lost holder, no evidence of its loss", build(
			csSpec{"a", 0, "x", 1, false, 500, []int{0, 400}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, []bool{false, false}}), map[string]int{VOverlap: 1}},
		{"lost holder within the bound", evidence(build(
			csSpec{"a", 0, "x", 1, false, 500, []int{0, 400}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, []bool{false, false}}),
			Evidence{Kind: "terminate_holder", At: at(20), Worker: 0, PID: 9, Keys: []string{"k"}}), map[string]int{}},
		{"lost holder told too late", evidence(build(
			csSpec{"a", 0, "x", 1, false, 3000, []int{0, 2500}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, false, -1, []int{30, 40}, nil}),
			Evidence{Kind: "terminate_holder", At: at(20), Worker: 0, PID: 9, Keys: []string{"k"}}), map[string]int{VLateNotice: 1}},
		{"evidence about another worker excuses nothing", evidence(build(
			csSpec{"a", 0, "x", 1, false, 500, []int{0, 400}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, []bool{false, false}}),
			Evidence{Kind: "terminate_holder", At: at(20), Worker: 2, PID: 9, Keys: []string{"k"}},
			Evidence{Kind: "cut", At: at(20), Worker: 1}), map[string]int{VOverlap: 1}},
		{"evidence after the later grant excuses nothing", evidence(build(
			csSpec{"a", 0, "x", 1, false, 500, []int{0, 400}, []bool{false, true}},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 40}, []bool{false, false}}),
			Evidence{Kind: "restart_fast", At: at(100), Worker: -1}), map[string]int{VOverlap: 1}},
		{"a lost holder granted first writes once after the next one began", evidence(begins(build( // seen in a campaign
			csSpec{"new", 3, "x", 2618, true, -1, []int{0, 43}, nil},
			csSpec{"old", 1, "x", 2498, false, 41, []int{40}, []bool{true}}), map[string]int{"old": -100}),
			Evidence{Kind: "session_end", At: at(-50), Worker: 1, PID: 7}), map[string]int{}},
		{"told only by Unlock, long after the loss", evidence(build(
			csSpec{"a", 0, "x", 1, false, -1, []int{0, 500, 2500}, nil}),
			Evidence{Kind: "cut", At: at(100), Worker: 0}), map[string]int{VNeverTold: 1}},
		{"told only by Unlock, within the bound", evidence(build(
			csSpec{"a", 0, "x", 1, false, -1, []int{0, 500, 900}, nil}),
			Evidence{Kind: "cut", At: at(100), Worker: 0}), map[string]int{}},
		{"a fault that ends no session tells nothing", evidence(build(
			csSpec{"a", 0, "x", 1, false, -1, []int{0, 500, 2500}, nil}),
			Evidence{Kind: "latency", At: at(100), Until: at(2000), Worker: 0}), map[string]int{}},
		{"a slow link ends no session", evidence(build(
			csSpec{"a", 0, "x", 1, false, -1, []int{0, 500, 2500}, nil}),
			Evidence{Kind: "slow_link", At: at(100), Until: at(2000), Worker: 0}), map[string]int{}},
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
		// Failover: a token granted after the promotion, on another key, lower than one granted before the primary
		// was lost (a promoted standby that lagged, its sequence behind).
		{"failover, a token after the promotion lower than one before", onKey(evidence(build(
			csSpec{"a", 0, "x", 100, true, -1, []int{0, 10}, nil},
			csSpec{"b", 1, "x", 40, true, -1, []int{3000, 3010}, nil}),
			Evidence{Kind: "failover", At: at(1000), Until: at(2000), Worker: -1}), "b", "k2"), map[string]int{VTokenOrder: 1}},
		{"failover, tokens go on above", onKey(evidence(build(
			csSpec{"a", 0, "x", 100, true, -1, []int{0, 10}, nil},
			csSpec{"b", 1, "x", 140, true, -1, []int{3000, 3010}, nil}),
			Evidence{Kind: "failover", At: at(1000), Until: at(2000), Worker: -1}), "b", "k2"), map[string]int{}},
		{"no failover, tokens of two keys are not compared", onKey(build(
			csSpec{"a", 0, "x", 100, true, -1, []int{0, 10}, nil},
			csSpec{"b", 1, "x", 40, true, -1, []int{3000, 3010}, nil}), "b", "k2"), map[string]int{}},
		{"failover, an old primary's grant recorded late without a pause lost its session", begins(onKey(evidence(build(
			csSpec{"a", 0, "x", 105, true, -1, []int{900, 910}, nil},
			csSpec{"b", 1, "x", 100, false, 2101, []int{2100}, nil}),
			Evidence{Kind: "failover", At: at(1000), Until: at(2000), Worker: -1}), "b", "k2"), map[string]int{"b": 2100}), map[string]int{}},
		{"failover, a holder paused across it recorded its grant late", func() *History {
			h := onKey(evidence(build(
				csSpec{"a", 0, "x", 100, true, -1, []int{0, 10}, nil},
				csSpec{"b", 1, "x", 40, true, -1, []int{3000, 3010}, nil}),
				Evidence{Kind: "failover", At: at(1000), Until: at(2000), Worker: -1}), "b", "k2")
			h.Pauses = []Pause{{Worker: 1, From: at(900), To: at(2900)}}
			return h
		}(), map[string]int{}},
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

	// Leases, judged by the lease table's log: two terms of one key whose lives overlap are two leases at once (a
	// promoted server that grants what the lost primary had granted or renewed past, a takeover that came too
	// early), whatever their holders wrote.
	t.Run("leases", func(t *testing.T) {
		life := func(granted, renewed, deleted int) *LeaseLife {
			l := &LeaseLife{Key: "k", Worker: -1, Granted: at(granted), Renewed: at(renewed)}
			if deleted >= 0 {
				l.Deleted = at(deleted)
			}
			return l
		}
		for _, tc := range []struct {
			name  string
			lives map[int64]*LeaseLife
			want  map[string]int
		}{
			{"one after the other", map[int64]*LeaseLife{1: life(0, 0, 250), 2: life(300, 300, -1)}, map[string]int{}},
			{"a takeover a lease length after the last renewal", map[int64]*LeaseLife{1: life(-1800, -1800, -1), 2: life(300, 300, -1)}, map[string]int{}},
			{"a grant while the other lived", map[int64]*LeaseLife{1: life(0, 0, -1), 2: life(300, 300, -1)}, map[string]int{VOverlap: 1}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				h := build(csSpec{"a", 0, "x", 1, true, -1, []int{10, 200}, nil}, csSpec{"b", 1, "x", 2, true, -1, []int{400, 450}, nil})
				h.Leases, h.LeaseLength = tc.lives, 2*time.Second
				got := kinds(Check(h))
				if len(got) != len(tc.want) || got[VOverlap] != tc.want[VOverlap] {
					t.Fatalf("got %v, want %v", got, tc.want)
				}
			})
		}
		// A sample of the promoted server (or of the standby, before it is promoted) may lack a lease granted or
		// renewed on the lost primary, for up to one lease length: no phantom then, one outside that window.
		for _, failover := range []bool{false, true} {
			h := build(csSpec{"a", 0, "x", 1, true, -1, []int{10, 200, 1500}, nil})
			h.Leases, h.LeaseLength = map[int64]*LeaseLife{1: life(0, 1000, 1600)}, 2*time.Second
			h.Samples = []Sample{{At: at(900), Held: map[string][]Holder{}}}
			if failover {
				h.Evidence = []Evidence{{Kind: "failover", At: at(500), Until: at(800), Worker: -1}}
			}
			if got, want := kinds(Check(h))[VPhantom], map[bool]int{false: 1, true: 0}[failover]; got != want {
				t.Errorf("a lease missing from a sample, failover %v: %d phantoms, want %d", failover, got, want)
			}
		}
		// The logs of a lost primary and of the promoted one share what the standby had received: counted once; a
		// renewal only the lost primary had extends the lease; the promoted server's grant of another term takes
		// the key over.
		shared := []leaseEntry{{At: at(0), Expires: at(2000), Op: "I", Key: 7, Term: 1}}
		lost := append(slices.Clone(shared), leaseEntry{At: at(900), Expires: at(2900), Op: "U", Key: 7, Term: 1})
		promoted := append(slices.Clone(shared), leaseEntry{At: at(3000), Expires: at(5000), Op: "U", Key: 7, Term: 2})
		lives := leaseLives(slices.Concat(lost, promoted))
		if len(lives) != 2 || !lives[1].Granted.Equal(at(0)) || !lives[1].Renewed.Equal(at(900)) ||
			!lives[2].Granted.Equal(at(3000)) || !lives[1].Replaced.Equal(at(3000)) {
			t.Fatalf("merged lives: %+v %+v", lives[1], lives[2])
		}
		// A mark of the holder (held past its work) is no renewal: the record did not change.
		marked := leaseLives([]leaseEntry{{At: at(0), Expires: at(2000), Op: "U", Key: 7, Term: 1},
			{At: at(500), Expires: at(2000), Op: "U", Key: 7, Term: 1}})
		if !marked[1].Renewed.Equal(at(0)) {
			t.Errorf("a mark counted as a renewal: %+v", marked[1])
		}
	})

	// The server's clock stepped: the log is read back to the real clock by the marks around each step, and what
	// was logged between them is not timed.
	t.Run("clock steps", func(t *testing.T) {
		got := correctClock([]leaseEntry{
			{At: at(0), Op: "I", Key: 1, Term: 1},
			{At: at(100), Op: "S", Term: 0},
			{At: at(20_150), Op: "U", Key: 1, Term: 1}, // read after the step: between the marks by the new offset
			{At: at(20_200), Op: "T", Term: 20_000},
			{At: at(20_300), Op: "D", Key: 1, Term: 1},
			{At: at(20_400), Op: "S", Term: 20_000},
			{At: at(20_420), Op: "I", Key: 3, Term: 3}, // read before the step: by the old offset
			{At: at(5_000), Op: "U", Key: 3, Term: 3},  // between the marks by neither: ambiguous
			{At: at(-9_500), Op: "T", Term: -10_000},
			{At: at(-9_000), Op: "I", Key: 2, Term: 2},
		})
		want := []struct {
			at        int
			ambiguous bool
		}{{0, false}, {150, false}, {300, false}, {420, false}, {-15_000, true}, {1000, false}}
		if len(got) != len(want) {
			t.Fatalf("got %d entries, want %d: %+v", len(got), len(want), got)
		}
		for i, w := range want {
			if !got[i].At.Equal(at(w.at)) || got[i].ambiguous != w.ambiguous {
				t.Errorf("entry %d: at %v ambiguous %v, want %v %v", i, got[i].At.Sub(at(0)), got[i].ambiguous, time.Duration(w.at)*time.Millisecond, w.ambiguous)
			}
		}
	})

	// A crash (restart_immediate) takes back the last grants and renewals, and the log with them: a holder's term
	// granted just before it, missing from the log, is no phantom; but it lives until one lease length after the
	// crash, and a grant of its key before then (a server without the quiet period after a crash) is two leases
	// at once, unless its holder had released it before the crash. A lease the log has lives as long, its last
	// renewals maybe lost: its holder writes on. Without the crash the missing term is a phantom.
	t.Run("crashes", func(t *testing.T) {
		crash := []Evidence{{Kind: "restart_immediate", At: at(500), Stopped: at(600), Until: at(1200), Worker: -1}}
		logged := func(term int64, granted int) *LeaseLife {
			return &LeaseLife{Key: "k", Worker: 1, Granted: at(granted), Renewed: at(granted)}
		}
		for _, tc := range []struct {
			name    string
			ev      []Evidence
			cleanA  bool
			bAt     int
			aWrites []int
			log     []int // when the log's other entries were written
			want    map[string]int
		}{
			{"no crash: a phantom", nil, false, 2700, []int{10, 200}, nil, map[string]int{VPhantom: 1}},
			{"lost, then the key granted a lease length after the crash", crash, false, 2700, []int{10, 200}, nil, map[string]int{}},
			{"lost, then the key granted at once after the crash", crash, false, 1300, []int{10, 200}, nil, map[string]int{VOverlap: 1}},
			{"lost, released before the crash", crash, true, 1300, []int{10, 200}, nil, map[string]int{}},
			{"lost, its holder writing past a lease length after the crash", crash, false, 5000, []int{10, 2400, 2900}, nil, map[string]int{VOverlap: 1, VNeverTold: 1}},
			// The log kept an entry written after the grant and before the crash: the grant was kept (WAL is kept
			// as a prefix), so its absence is a phantom.
			{"missing though the log kept a later entry", crash, false, 2700, []int{10, 200}, []int{300}, map[string]int{VPhantom: 1}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				h := build(csSpec{"a", 0, "x", 1, tc.cleanA, -1, tc.aWrites, nil}, csSpec{"b", 1, "x", 2, true, -1, []int{tc.bAt, tc.bAt + 50}, nil})
				h.Leases, h.LeaseLength, h.Evidence = map[int64]*LeaseLife{2: logged(2, tc.bAt)}, 2*time.Second, tc.ev
				for _, ms := range tc.log {
					h.LeaseLog = append(h.LeaseLog, at(ms))
				}
				got := kinds(Check(h))
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
		// A release and the next grant of its key, both taken back by the crash: the log has the first lease
		// renewed at 0 and nothing after. Its holder called Unlock at 445 ms, which returned at 470; the other worker
		// was granted the key at 460, between the two (the release had deleted the row by then). The lease ended
		// once its release began: no overlap. A grant before the release began (440) is two leases at once; so is
		// the grant at 460 when the history says only when the release returned.
		for _, tc := range []struct {
			bAt     int
			release bool
			want    int
		}{{460, true, 0}, {440, true, 1}, {460, false, 1}} {
			h := build(csSpec{"a", 0, "x", 1, true, -1, []int{10, 300}, nil}, csSpec{"b", 1, "x", 2, true, -1, []int{tc.bAt, 2700}, nil})
			h.Leases, h.LeaseLength, h.Evidence = map[int64]*LeaseLife{1: {Key: "k", Worker: 0, Granted: at(0), Renewed: at(0)}}, 2*time.Second, crash
			h.LeaseLog = []time.Time{at(0)}
			h.CS["a"].End = at(470)
			if tc.release {
				h.CS["a"].Release = at(445)
			}
			if got := kinds(Check(h))[VOverlap]; got != tc.want {
				t.Errorf("the next grant at %d ms, the release's start recorded %v: %d overlaps, want %d (%v)", tc.bAt, tc.release, got, tc.want, Check(h))
			}
		}
		// A lease in the log, renewed last at 400 ms (its renewal at 600 ms lost, with the crash at 500): its holder
		// writes until 2.7 s, within a lease length of the crash (and the slack); without the crash, past the lease's end at 2.4 s.
		for _, crashed := range []bool{false, true} {
			h := build(csSpec{"a", 0, "x", 1, true, -1, []int{10, 2700}, nil})
			h.Leases, h.LeaseLength = map[int64]*LeaseLife{1: {Key: "k", Worker: 0, Granted: at(0), Renewed: at(400)}}, 2*time.Second
			if crashed {
				h.Evidence = crash
			}
			if got, want := kinds(Check(h))[VOverlap], map[bool]int{false: 1, true: 0}[crashed]; got != want {
				t.Errorf("a holder writing on after its renewal the log lacks, crash %v: %d overlaps, want %d", crashed, got, want)
			}
		}
	})

	// Belief against belief: the holder of the earlier term stops believing before the later term's grant, on the
	// real clock; a broken lease's holder may act until its trust has ended, a stopped one or one whose Locker was
	// closed until just after it resumed or the close.
	t.Run("beliefs", func(t *testing.T) {
		for _, tc := range []struct {
			name  string
			ev    []Evidence
			pause []Pause
			b     int // the later holder's grant (its first write)
			want  int
		}{
			{"one after the other", nil, nil, 1000, 0},
			{"the later one granted while the earlier one wrote", nil, nil, 400, 1},
			{"broken, told within its trust", []Evidence{{Kind: "break_lease", At: at(300), Term: 1, Worker: 0}}, nil, 400, 0},
			{"broken long before", []Evidence{{Kind: "break_in_flight", At: at(-3000), Term: 1, Worker: 0}}, nil, 400, 1},
			{"stopped across the grant", nil, []Pause{{Worker: 0, From: at(300), To: at(500)}}, 400, 0},
			{"closed", []Evidence{{Kind: "close_locker", At: at(300), Worker: 0}}, nil, 400, 0},
		} {
			t.Run(tc.name, func(t *testing.T) {
				h := build(csSpec{"a", 0, "x", 1, false, -1, []int{10, 900}, nil}, csSpec{"b", 1, "x", 2, true, -1, []int{tc.b, tc.b + 50}, nil})
				h.Evidence, h.Pauses, h.LeaseLength = tc.ev, tc.pause, 2*time.Second
				for _, c := range h.CS {
					for _, w := range h.Writes {
						if w.CS == c.ID {
							c.Writes = append(c.Writes, w)
						}
					}
				}
				if got := len(h.beliefs(map[int64]*CS{1: h.CS["a"], 2: h.CS["b"]})); got != tc.want {
					t.Errorf("%d overlaps, want %d", got, tc.want)
				}
			})
		}
	})

	// A broken lease's holder learns at its next renewal; a holder stopped after the break but before that renewal
	// learns once it resumes (as told 1 ms after a stop of 8.3 s in a campaign): no late notice; told as late with
	// no stop, it is one.
	t.Run("a broken lease's holder stopped before its next renewal", func(t *testing.T) {
		for _, tc := range []struct {
			pause []Pause
			want  int
		}{{[]Pause{{Worker: 0, From: at(650), To: at(8600)}}, 0}, {nil, 1}} {
			h := evidence(build(csSpec{"a", 0, "x", 1, false, 8601, []int{10, 200}, nil}),
				Evidence{Kind: "break_lease", At: at(300), Term: 1, Worker: 0})
			h.CS["a"].End = at(8602)
			h.Leases = map[int64]*LeaseLife{1: {Key: "k", Worker: 0, Granted: at(0), Renewed: at(0), Deleted: at(300)}}
			h.Pauses, h.LeaseLength = tc.pause, 2*time.Second
			if got := kinds(Check(h)); got[VLateNotice] != tc.want || len(got) != tc.want {
				t.Errorf("stopped %v: got %v, want %d late notice(s) and nothing else", tc.pause, got, tc.want)
			}
		}
	})

	// A lease no holder was told of (its caller gave up on its grant) is gone within orphanBound of its grant, or of
	// the end of the last fault that could hold its deletion back; one whose worker died, or whose Locker was
	// closed, is excused.
	t.Run("orphans", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			gone int // deleted (ms), or taken over when negative
			ev   []Evidence
			want int
		}{
			{"deleted soon", 1200, nil, 0},
			{"deleted late", 4000, nil, 1},
			{"taken over late", -4000, nil, 1},
			{"deleted soon after a fault on its path", 4000, []Evidence{{Kind: "late_answers", At: at(500), Until: at(3000), Worker: 1}}, 0},
			{"deleted late after a fault", 5000, []Evidence{{Kind: "pgbouncer_stall", At: at(500), Until: at(3000), Worker: -1}}, 1},
			{"its worker killed", 8000, []Evidence{{Kind: "sigkill", At: at(1100), Worker: 1}}, 0},
			{"its Locker closed", 8000, []Evidence{{Kind: "close_locker", At: at(1100), Worker: 1}}, 0},
			{"a fault on another worker", 5000, []Evidence{{Kind: "cut_edge", At: at(500), Until: at(4000), Worker: 2}}, 1},
		} {
			t.Run(tc.name, func(t *testing.T) {
				h := build(csSpec{"a", 0, "x", 1, true, -1, []int{10, 200}, nil})
				l := &LeaseLife{Key: "k", Worker: 1, Granted: at(1000), Renewed: at(1000)}
				if tc.gone >= 0 {
					l.Deleted = at(tc.gone)
				} else {
					l.Replaced = at(-tc.gone)
				}
				h.Leases = map[int64]*LeaseLife{1: {Key: "k", Worker: 0, Granted: at(0), Renewed: at(0), Deleted: at(250)}, 9: l}
				h.Evidence, h.LeaseLength = tc.ev, 2*time.Second
				if got := kinds(Check(h))[VOrphan]; got != tc.want {
					t.Errorf("%d orphans, want %d", got, tc.want)
				}
			})
		}
	})

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
		// A sample whose statement began at 150 ms but read pg_locks only by 190 ms (a loaded server), after the
		// holder's last write at 200 ms less the margin: it may show the moment after the release.
		h = build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 100, 200}, nil})
		h.Samples = []Sample{{At: at(150), Read: at(190), Held: map[string][]Holder{}}}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("a sample read after the belief's end was judged: got %v", got)
		}
		h = build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 100, 200}, nil})
		h.Samples = []Sample{{At: at(150), Read: at(160), Held: map[string][]Holder{}}}
		if got := kinds(Check(h)); got[VPhantom] != 1 {
			t.Fatalf("a sample read well inside the belief, nothing held: got %v", got)
		}
	})
	t.Run("paused holder is judged by the fence", func(t *testing.T) {
		// Stopped from 10 ms to 2.9 s; the server ended its idle session at 25 ms (its log says so, and pg_locks had
		// shown that backend holding the key); it wrote once more on waking and was told at 3.1 s, within the
		// bound of its resumption.
		paused := func(refused bool) *History {
			h := evidence(build(
				csSpec{"a", 0, "x", 1, false, 3100, []int{0, 3000}, []bool{false, refused}},
				csSpec{"b", 1, "x", 2, false, -1, []int{30, 40}, nil}),
				Evidence{Kind: "session_end", At: at(25), Worker: 0, PID: 9})
			h.Pauses = []Pause{{Worker: 0, From: at(10), To: at(2900)}}
			h.Samples = []Sample{{At: at(5), Held: map[string][]Holder{"k": {{App: "w0", PID: 9, Granted: true}}}}}
			return h
		}
		if got := kinds(Check(paused(true))); len(got) != 0 {
			t.Fatalf("paused holder refused: got %v", got)
		}
		if got := kinds(Check(paused(false))); got[VStaleToken] != 1 || got[VOverlap] != 0 {
			t.Fatalf("paused holder accepted after a newer token: got %v", got)
		}
		// The end of a backend pg_locks never showed holding the key excuses nothing once another one was seen.
		h := paused(true)
		h.Evidence[0].PID = 10
		if got := kinds(Check(h)); got[VOverlap] != 1 {
			t.Fatalf("another backend's end excused the overlap: got %v", got)
		}
		// Told after the bound from its resumption: late.
		h = paused(true)
		h.CS["a"].Told = at(4000)
		h.Writes[len(h.Writes)-1].At = at(3950)
		if got := kinds(Check(h)); got[VLateNotice] != 1 {
			t.Fatalf("told 1.1 s after the bound: got %v", got)
		}
	})
	t.Run("evidence names the right session", func(t *testing.T) {
		// A cut of the worker 50 ms before a grant (the new connection was made after it: pg_locks showed it
		// holding later) is not that section's loss; the terminate of its own backend is, and it was told at once.
		for _, kind := range []string{"cut", "close_locker"} {
			h := evidence(begins(build(
				csSpec{"c", 0, "x", 1, false, 1510, []int{60, 400, 800, 1200, 1450}, nil}), map[string]int{"c": 50}),
				Evidence{Kind: kind, At: at(0), Worker: 0},
				Evidence{Kind: "terminate_holder", At: at(1500), Worker: 0, PID: 9, Keys: []string{"k"}})
			h.Samples = []Sample{heldAt(500, Holder{App: "w0", PID: 9, Granted: true}), heldAt(1000, Holder{App: "w0", PID: 9, Granted: true})}
			if got := kinds(Check(h)); len(got) != 0 {
				t.Errorf("%s 50 ms before the grant: got %v, want nothing", kind, got)
			}
		}
		// The end of another backend of the worker excuses nothing once the section's own backend is known.
		h := evidence(build(
			csSpec{"a", 0, "x", 1, false, -1, []int{0, 40, 80}, []bool{false, true, true}},
			csSpec{"b", 1, "x", 2, true, -1, []int{30, 60, 100}, nil}),
			Evidence{Kind: "session_end", At: at(35), Worker: 0, PID: 77})
		h.CS["a"].Told, h.CS["a"].ToldBy, h.CS["a"].PID = at(85), "unlock", 5
		if got := kinds(Check(h)); got[VOverlap] != 1 {
			t.Errorf("another backend's end: got %v, want an overlap", got)
		}
		h.Evidence[0].PID = 5 // its own: excused
		if got := kinds(Check(h)); got[VOverlap] != 0 {
			t.Errorf("its own backend's end: got %v, want no overlap", got)
		}
		// A shared holder's section is not excused by the terminate of a sibling shared holder's backend.
		h = evidence(build(
			csSpec{"r2", 0, "s", 1, false, -1, []int{0, 100, 200}, nil},
			csSpec{"b", 1, "x", 2, true, -1, []int{150, 250}, nil}),
			Evidence{Kind: "terminate_holder", At: at(120), Worker: 0, PID: 5, Keys: []string{"k"}})
		h.CS["r2"].Told, h.CS["r2"].ToldBy, h.CS["r2"].PID = at(210), "unlock", 6
		h.Samples = []Sample{heldAt(50, Holder{App: "w0", PID: 5, Granted: true}, Holder{App: "w0", PID: 6, Granted: true})}
		if got := kinds(Check(h)); got[VOverlap] != 1 {
			t.Errorf("a sibling's backend terminated: got %v, want an overlap", got)
		}
		// The server logs a backend's end just after it released the key: the next holder's grant may come first.
		h = evidence(begins(build(
			csSpec{"old", 0, "x", 1, false, 2010, []int{0, 2005}, []bool{false, true}},
			csSpec{"new", 1, "x", 2, true, -1, []int{1505, 1800}, nil}), map[string]int{"new": 1501}),
			Evidence{Kind: "session_end", At: at(1525), Worker: 0, PID: 9})
		h.Pauses = []Pause{{Worker: 0, From: at(10), To: at(2000)}}
		h.Samples = []Sample{heldAt(5, Holder{App: "w0", PID: 9, Granted: true})}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Errorf("its backend's end logged 24 ms after the next grant: got %v, want nothing", got)
		}
	})
	t.Run("grant order by token", func(t *testing.T) {
		// Stopped between its grant (token 10) and its record of it: the server ended its session, another
		// holder got the key (token 20), and the stopped one, resumed, wrote once (refused) before it was told.
		h := evidence(begins(build(
			csSpec{"new", 1, "x", 20, true, -1, []int{1520, 2000, 2500, 3000}, nil},
			csSpec{"old", 0, "x", 10, false, 2010, []int{2005}, []bool{true}}), map[string]int{"new": 1510, "old": 2000}),
			Evidence{Kind: "sigstop", At: at(0), Until: at(2000), Worker: 0},
			Evidence{Kind: "session_end", At: at(1500), Worker: 0, PID: 9})
		h.Pauses = []Pause{{Worker: 0, From: at(0), To: at(2000)}}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Errorf("got %v, want nothing", got)
		}
		// The same, stopped for 8 s: its backend (the one the library named) ended long before the next grant.
		h = evidence(begins(build(
			csSpec{"new", 1, "x", 20, true, -1, []int{8520, 9000, 9500}, nil},
			csSpec{"old", 0, "x", 10, false, 8610, []int{8605}, []bool{true}}), map[string]int{"new": 8510, "old": 8600}),
			Evidence{Kind: "sigstop", At: at(100), Until: at(8590), Worker: 0},
			Evidence{Kind: "session_end", At: at(1700), Worker: 0, PID: 9})
		h.CS["old"].PID = 9
		h.Pauses = []Pause{{Worker: 0, From: at(100), To: at(8590)}}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Errorf("stopped 8 s: got %v, want nothing", got)
		}
		h.Evidence[1].PID = 10 // another backend's end: nothing excuses it
		if got := kinds(Check(h)); got[VOverlap] != 1 {
			t.Errorf("stopped 8 s, another backend ended: got %v, want an overlap", got)
		}
	})
	t.Run("leak during the run", func(t *testing.T) {
		var samples []Sample
		for ms := 0; ms <= 2000; ms += 100 {
			samples = append(samples, Sample{At: at(ms), Held: map[string][]Holder{"k": {{App: "w0", PID: 9, Granted: true}}}})
		}
		h := build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 1000, 2100}, nil})
		h.Samples = samples
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("held while its holder believed it: got %v", got)
		}
		h = build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 300}, nil})
		h.Samples = samples
		if got := kinds(Check(h)); got[VLeak] != 1 {
			t.Fatalf("held 1.7 s after a clean release: got %v", got)
		}
		h = build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 300}, nil})
		h.Samples = samples[:10] // 0.6 s after the release: within the bound
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("held 0.6 s after the release: got %v", got)
		}
		h = evidence(build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 300}, nil}),
			Evidence{Kind: "blackhole", At: at(200), Until: at(1500), Worker: 0})
		h.Samples = samples // a client that gave up on its session behind a blackhole: the server keeps it a while
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("held 1.7 s after a blackhole: got %v", got)
		}
		// A watcher that took a slow link for a dead one closed its session: the close reaches the server late.
		h = evidence(build(csSpec{"a", 0, "x", 1, false, 250, []int{0, 200}, nil}),
			Evidence{Kind: "slow_link", At: at(100), Until: at(1200), Worker: 0})
		h.Samples = samples
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("held 1.7 s after a slow link: got %v", got)
		}
		// A stopped worker records nothing: a lock it holds while stopped, and for a while after, is no leak.
		h = build(csSpec{"a", 0, "x", 1, true, -1, []int{0, 300}, nil})
		h.Samples = samples
		h.Pauses = []Pause{{Worker: 0, From: at(400), To: at(1800)}}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("held by a stopped worker: got %v", got)
		}
		// A lock left on one backend is a leak even while the worker's other holders of that key (shared, on
		// another backend) come and go.
		var specs []csSpec
		for i, start := 0, 0; start < 5000; i, start = i+1, start+800 {
			specs = append(specs, csSpec{string(rune('a' + i)), 0, "s", int64(i + 1), true, -1, []int{start + 5, start + 100}, nil})
		}
		h = build(specs...)
		for _, sp := range specs {
			h.CS[sp.id].Begin, h.CS[sp.id].PID = at(sp.writes[0]-1), 8
		}
		for ms := 0; ms <= 5000; ms += 100 {
			rows := []Holder{{App: "w0", PID: 7, Granted: true}}
			if ms%800 <= 100 {
				rows = append(rows, Holder{App: "w0", PID: 8, Granted: true})
			}
			h.Samples = append(h.Samples, heldAt(ms, rows...))
		}
		if got := kinds(Check(h)); got[VLeak] != 1 {
			t.Errorf("pid 7 held k for 5 s, no holder of worker 0 held it there: got %v", got)
		}
		// A lease whose holder's process was killed stays until it is taken over: no leak, also once the worker's
		// next process is stopped much later (a pause moves when a row was first seen; the kill stays before it).
		lease := func(ev ...Evidence) *History {
			h := evidence(build(csSpec{"a", 0, "x", 1, false, -1, []int{0, 300}, nil}), ev...)
			for ms := 0; ms <= 60_000; ms += 100 {
				h.Samples = append(h.Samples, heldAt(ms, Holder{App: "w0", Granted: true, Term: 5}))
			}
			return h
		}
		h = lease(Evidence{Kind: "sigkill", At: at(350), Worker: 0})
		h.Pauses = []Pause{{Worker: 0, From: at(50_000), To: at(52_000)}}
		if got := kinds(Check(h)); got[VLeak] != 0 {
			t.Errorf("a killed holder's lease, its worker's next process stopped later: got %v", got)
		}
		h = lease()
		h.Pauses = []Pause{{Worker: 0, From: at(50_000), To: at(52_000)}}
		if got := kinds(Check(h)); got[VLeak] != 1 {
			t.Errorf("a lease left by a live holder for a minute, its worker stopped at 50 s: got %v", got)
		}
		// Its release failed as the server restarted; its worker's calls failed to connect until 4.5 s (the
		// restart's end, 1 s, and PgBouncer's retry say 3 s): the lease is deleted within the bound of that.
		restarted := func(unreachable ...int) *History {
			h := evidence(build(csSpec{"a", 0, "x", 1, false, -1, []int{0, 300}, nil}),
				Evidence{Kind: "restart_immediate", At: at(250), Until: at(1000), Worker: -1})
			for ms := 0; ms <= 5500; ms += 100 {
				h.Samples = append(h.Samples, heldAt(ms, Holder{App: "w0", Granted: true, Term: 5}))
			}
			h.Unreachable = map[int][]time.Time{}
			for _, ms := range unreachable {
				h.Unreachable[0] = append(h.Unreachable[0], at(ms))
			}
			return h
		}
		if got := kinds(Check(restarted(1500, 3000, 4500))); got[VLeak] != 0 {
			t.Errorf("a lease its worker could not delete, its calls failing to connect until 4.5 s: got %v", got)
		}
		if got := kinds(Check(restarted())); got[VLeak] != 1 {
			t.Errorf("a lease left 2.5 s past the restart's end and PgBouncer's retry, its worker's calls connecting: got %v", got)
		}
	})
	t.Run("Lead terms matched to their locks", func(t *testing.T) {
		// Term 1's lock is lost and a sibling's term 2 granted before term 1's fn returns: both ends are recorded.
		path := filepath.Join(t.TempDir(), "h.jsonl")
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		w := &worker{hist: f}
		w.obs.w = w
		o := &w.obs
		o.LockEnd(advlock.LockEnd{Key: leadKey, Token: 1, Cause: advlock.CauseLost, Err: advlock.ErrLockLost})
		o.returned(1, event{T: "end", CS: "0.0.1", Told: 1, ToldBy: "done", Cause: "lost", Unlock: "ok"})
		o.returned(2, event{T: "end", CS: "0.0.2", Unlock: "ok"})
		o.LockEnd(advlock.LockEnd{Key: leadKey, Token: 2, Cause: advlock.CauseReleased, Err: advlock.ErrNotHeld})
		f.Close()
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		ends := map[string]event{}
		for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
			var e event
			if err := json.Unmarshal([]byte(line), &e); err != nil {
				t.Fatal(err)
			}
			ends[e.CS] = e
		}
		if len(ends) != 2 || ends["0.0.1"].Clean || !ends["0.0.2"].Clean {
			t.Errorf("term ends recorded: %+v, want term 1 not clean and term 2 clean", ends)
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
		h.SemSlots = map[string]int{"slota": 0, "slotb": 1, "slotc": 2}
		h.SemN = 3
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("3 of 3: got %v", got)
		}
		// Of 2: a holder of slot 2, by its own account.
		h.SemN = 2
		if got := kinds(Check(h)); got[VSemaphore] != 1 {
			t.Fatalf("a holder of slot 2 of 2: got %v", got)
		}
		h.CS["c"].Op = "lock" // the same key held by a plain lock is no semaphore holder
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("2 slots and a plain lock: got %v", got)
		}
		// Three clean holders of slots at once (two of them on slot 0), whatever else is said of them.
		h.CS["c"].Op, h.CS["c"].Key = "semaphore", "slota"
		for i := range h.Writes {
			if h.Writes[i].CS == "c" {
				h.Writes[i].Key = "slota"
			}
		}
		if got := kinds(Check(h)); got[VSemaphore] != 1 || got[VOverlap] == 0 {
			t.Fatalf("3 holders of 2 slots: got %v", got)
		}
		h.CS["c"].Op, h.CS["c"].Key = "lock", "slotc"
		for i := range h.Writes {
			if h.Writes[i].CS == "c" {
				h.Writes[i].Key = "slotc"
			}
		}
		// By pg_locks: a backend holding slot 2 of a semaphore of 2, or three backends holding its slots.
		h.AppName, h.WorkerOf = nil, nil // this sample alone is no record of who believed what
		h.Samples = []Sample{{At: at(50), Held: map[string][]Holder{"slota": {{App: "w0", Granted: true}}, "slotb": {{App: "w1", Granted: true}}}}}
		if got := kinds(Check(h)); len(got) != 0 {
			t.Fatalf("2 slots held: got %v", got)
		}
		h.Samples[0].Held["slotc"] = []Holder{{App: "w9", Granted: true}}
		if got := kinds(Check(h)); got[VSemaphore] != 2 {
			t.Fatalf("slot 2 held, 3 holders: got %v", got)
		}
	})
	t.Run("leaks and worker problems", func(t *testing.T) {
		h := build()
		h.Leaked = []Leftover{{Key: "k", App: "w0", Granted: true}}
		h.Problems = []Violation{{VPanic, "panic: x"}, {VHang, "lock"}, {VGoroutines, "goroutine 7"}, {VDied, "exit status 2"}}
		if got := kinds(Check(h)); got[VLeak] != 1 || got[VPanic] != 1 || got[VHang] != 1 || got[VGoroutines] != 1 || got[VDied] != 1 {
			t.Fatalf("got %v", got)
		}
		// A lease released cleanly just before the server crashed: the crash may take the release back (it commits
		// without waiting for its WAL), and its row then stays until another takes the key over. Not a leak then; a
		// leak without the crash.
		for _, crashed := range []bool{false, true} {
			h := build(csSpec{"a", 0, "x", 7, true, -1, []int{10, 200}, nil})
			h.Leaked = []Leftover{{Key: "k", App: "w0", Granted: true, Term: 7}}
			if crashed {
				h.Evidence = []Evidence{{Kind: "restart_immediate", At: at(300), Worker: -1}}
			}
			if got, want := kinds(Check(h))[VLeak], map[bool]int{false: 1, true: 0}[crashed]; got != want {
				t.Errorf("a released lease left, crash %v: %d leaks, want %d", crashed, got, want)
			}
		}
		// A lease a failover brought back: the lost primary's log says it was deleted, the promoted server still has
		// its row. Not a leak.
		h = build(csSpec{"a", 0, "x", 7, false, 150, []int{10, 200}, nil})
		h.Leaked = []Leftover{{Key: "k", App: "w0", Granted: true, Term: 7}}
		h.Leases, h.LeaseLength = map[int64]*LeaseLife{7: {Key: "k", Granted: at(0), Renewed: at(0), Deleted: at(300)}}, 2*time.Second
		if got := kinds(Check(h))[VLeak]; got != 0 {
			t.Errorf("a lease deleted on a server that failed over, left on the promoted one: %d leaks, want 0", got)
		}
	})
}
