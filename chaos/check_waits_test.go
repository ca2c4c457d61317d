package main

import (
	"fmt"
	"github.com/advlock/advlock/internal/session"
	"strings"
	"testing"
	"time"
)

// pairSpec is a pair operation: it holds key held from hold[0] to hold[1] (ms; told of a loss at told, or -1) and
// waits for key wants from wait[0] to wait[1], which ended with result.
type pairSpec struct {
	id          string
	worker      int
	held, wants string
	hold, wait  [2]int
	told        int
	result      string
}

func pairs(specs ...pairSpec) *History {
	h := &History{CS: map[string]*CS{}, Bound: time.Second, DeadlockBound: DeadlockBound, RunEnd: at(100_000)}
	for _, s := range specs {
		c := &CS{ID: s.id, Worker: s.worker, Op: "pair", Key: s.held, Mode: "x", Begin: at(s.hold[0]), End: at(s.hold[1]),
			Ended: true, Clean: s.told < 0}
		if s.told >= 0 {
			c.Told = at(s.told)
		}
		h.CS[s.id] = c
		h.Waits = append(h.Waits, &Wait{CS: s.id, Worker: s.worker, Op: "pair", Key: s.wants, Mode: "x", Start: at(s.wait[0]), End: at(s.wait[1]), Result: s.result})
	}
	return h
}

// The deadlock rules, each shown to fire, with the allowed cases beside them.
func TestCheckerDeadlocks(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    *History
		want map[string]int
	}{
		{"a cycle broken by one ErrDeadlock", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 1210}, [2]int{100, 1200}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 2000}, [2]int{150, 1300}, -1, "ok"}), map[string]int{}},
		{"a three-cycle across two workers broken once", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 1600}, [2]int{100, 1500}, -1, "ok"},
			pairSpec{"y", 0, "B", "C", [2]int{10, 1800}, [2]int{120, 1700}, -1, "ok"},
			pairSpec{"z", 1, "C", "A", [2]int{20, 1410}, [2]int{140, 1400}, -1, "deadlock"}), map[string]int{}},
		{"a cycle nothing broke", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 8010}, [2]int{100, 8000}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 8060}, [2]int{150, 8050}, -1, "timeout"}), map[string]int{VDeadlockHang: 1}},
		{"a cycle broken by a timeout past the bound", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 3600}, [2]int{100, 3550}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 3700}, [2]int{150, 3650}, -1, "ok"}), map[string]int{VDeadlockHang: 1}},
		{"a cycle that formed late in a wait, broken by its timeout within the bound", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 8010}, [2]int{100, 8000}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{6000, 8100}, [2]int{6100, 8050}, -1, "ok"}), map[string]int{}},
		{"a cycle whose worker was stopped", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 8010}, [2]int{100, 8000}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 8060}, [2]int{150, 8050}, -1, "timeout"}),
			Evidence{Kind: "sigstop", At: at(200), Until: at(7000), Worker: 1}), map[string]int{}},
		{"a fault on another worker excuses no hang", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 8010}, [2]int{100, 8000}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 8060}, [2]int{150, 8050}, -1, "timeout"}),
			Evidence{Kind: "sigstop", At: at(200), Until: at(7000), Worker: 2}), map[string]int{VDeadlockHang: 1}},
		{"a cycle formed as its worker's blackhole had just ended (its Locker not yet reconnected)", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 8010}, [2]int{100, 8000}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 8060}, [2]int{150, 8050}, -1, "timeout"}),
			Evidence{Kind: "blackhole", At: at(-2000), Until: at(-500), Worker: 1}), map[string]int{}},
		{"a cycle formed past the loss bound after its worker's blackhole ended", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 8010}, [2]int{100, 8000}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 8060}, [2]int{150, 8050}, -1, "timeout"}),
			Evidence{Kind: "blackhole", At: at(-3000), Until: at(-1300), Worker: 1}), map[string]int{VDeadlockHang: 1}},
		{"a terminate on its worker excuses no hang", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 8010}, [2]int{100, 8000}, -1, "timeout"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 8060}, [2]int{150, 8050}, -1, "timeout"}),
			Evidence{Kind: "terminate_holder", At: at(500), Worker: 1, PID: 77}), map[string]int{VDeadlockHang: 1}},
		{"a victim past the bound", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 4010}, [2]int{100, 4000}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 4100}, [2]int{150, 4050}, -1, "ok"}), map[string]int{VDeadlockHang: 1}},
		{"a victim past the bound across a restart", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 4010}, [2]int{100, 4000}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 4100}, [2]int{150, 4050}, -1, "ok"}),
			Evidence{Kind: "restart_fast", At: at(1000), Worker: -1}), map[string]int{}},
		{"a victim past the bound, the server restarting until just after the cycle formed", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 4010}, [2]int{100, 4000}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 4100}, [2]int{150, 4050}, -1, "ok"}),
			Evidence{Kind: "restart_immediate", At: at(-3000), Until: at(200), Worker: -1}), map[string]int{}},
		{"a victim past the bound, a restart long before", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 4010}, [2]int{100, 4000}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 4100}, [2]int{150, 4050}, -1, "ok"}),
			Evidence{Kind: "restart_immediate", At: at(-3000), Until: at(-2500), Worker: -1}), map[string]int{VDeadlockHang: 1}},
		{"ErrDeadlock while another worker was behind a blackhole", evidence(pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 1210}, [2]int{100, 1200}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "C", [2]int{50, 2000}, [2]int{150, 300}, -1, "ok"}),
			Evidence{Kind: "blackhole", At: at(500), Until: at(1500), Worker: 2}), map[string]int{}},
		{"both waits of a cycle gave up", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 1210}, [2]int{100, 1200}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 1260}, [2]int{150, 1250}, -1, "deadlock"}), map[string]int{VDoubleDeadlock: 1}},
		{"ErrDeadlock behind a holder that waits for nothing", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 1210}, [2]int{100, 1200}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "C", [2]int{50, 2000}, [2]int{150, 300}, -1, "ok"}), map[string]int{VFalseDeadlock: 1}},
		{"ErrDeadlock after the cycle had been broken", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 2010}, [2]int{100, 2000}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 1000}, [2]int{150, 1000}, 1000, "lost"}), map[string]int{VFalseDeadlock: 1}},
		{"ErrDeadlock as the other wait of the cycle ended", pairs(
			pairSpec{"x", 0, "A", "B", [2]int{0, 1210}, [2]int{100, 1200}, -1, "deadlock"},
			pairSpec{"y", 1, "B", "A", [2]int{50, 1100}, [2]int{150, 1100}, 1100, "lost"}), map[string]int{}},
	} {
		t.Run(tc.name, func(t *testing.T) { wantViolations(t, tc.h, tc.want) })
	}
}

// queueSpec is a reader's or writer's wait for the queue key, from wait[0] to wait[1] (ms), which ended with
// result, and, when granted, the section its grant began (hold, ms).
type queueSpec struct {
	id     string
	worker int
	mode   string
	wait   [2]int
	result string
	hold   [2]int
}

func queueHistory(specs ...queueSpec) *History {
	h := &History{CS: map[string]*CS{}, Bound: time.Second, DeadlockBound: DeadlockBound, StarveBound: StarveBound, RunEnd: at(100_000)}
	for _, s := range specs {
		op := map[string]string{"s": "reader", "x": "writer"}[s.mode]
		h.Waits = append(h.Waits, &Wait{ID: s.id, Worker: s.worker, Op: op, Key: "q", Mode: s.mode, Start: at(s.wait[0]),
			End: at(s.wait[1]), Result: s.result})
		if s.result == "ok" {
			h.CS[s.id+".cs"] = &CS{ID: s.id + ".cs", Worker: s.worker, Op: op, Key: "q", Mode: s.mode, Begin: at(s.hold[0]),
				End: at(s.hold[1]), Ended: true, Clean: true, Wait: s.id}
		}
	}
	return h
}

// readersFrom are readers of worker 1 that come and go from ms on, each holding 900 ms and the next one granted
// 600 ms after the one before, until ms to: the key is never free of them.
func readersFrom(from, to int) []queueSpec {
	var out []queueSpec
	for i, start := 0, from; start < to; i, start = i+1, start+600 {
		out = append(out, queueSpec{fmt.Sprintf("r%d", i), 1, "s", [2]int{start, start + 1}, "ok", [2]int{start + 1, start + 900}})
	}
	return out
}

// starvedWriter is a writer of worker 0 that came behind a reader of worker 2 and waited 8 s while readers that
// came after it were let in.
func starvedWriter() *History {
	return queueHistory(append(readersFrom(700, 8100),
		queueSpec{"a", 2, "s", [2]int{0, 1}, "ok", [2]int{1, 800}},
		queueSpec{"w", 0, "x", [2]int{100, 8100}, "not_acquired", [2]int{}})...)
}

// crowdHistory is queueHistory whose waits are a crowd's writers, each statement of a wait 300 ms.
func crowdHistory(specs ...queueSpec) *History {
	h := queueHistory(specs...)
	h.WaitSlice = 300 * time.Millisecond
	for _, w := range h.Waits {
		w.Op = "crowd"
	}
	for _, c := range h.CS {
		c.Op = "crowd"
	}
	return h
}

// The order rule: a crowd's writer granted after one that began later; and the chances a campaign gave a line that
// lets a later wait pass (a later wait recorded a whole slice, 300 ms here, before an earlier one returned).
func TestCheckerOvertaken(t *testing.T) {
	defaultSlice := func(h *History) *History { h.WaitSlice = 0; return h } // the library's, 900 ms
	for _, tc := range []struct {
		name    string
		h       *History
		want    map[string]int
		chances int
	}{
		{"overtaken by a writer that began 1.6 s later", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 2500}, "ok", [2]int{2500, 2600}},
			queueSpec{"w2", 1, "x", [2]int{1600, 2000}, "ok", [2]int{2000, 2100}}), map[string]int{VOvertaken: 1}, 1},
		{"overtaken with no chance counted (the later wait's try between two slices)", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 1900}, "ok", [2]int{1900, 2000}},
			queueSpec{"w2", 1, "x", [2]int{1600, 1700}, "ok", [2]int{1700, 1750}}), map[string]int{VOvertaken: 1}, 0},
		{"granted in the order they came", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 1000}, "ok", [2]int{1000, 1100}},
			queueSpec{"w2", 1, "x", [2]int{600, 1100}, "ok", [2]int{1100, 1200}}), map[string]int{}, 0},
		{"granted in the order they came, the later one recorded a slice before", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 2700}, "ok", [2]int{2700, 2800}},
			queueSpec{"w2", 1, "x", [2]int{1600, 2900}, "ok", [2]int{2900, 3000}}), map[string]int{}, 1},
		{"the later one recorded exactly a slice before", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 1900}, "ok", [2]int{1900, 2000}},
			queueSpec{"w2", 1, "x", [2]int{1600, 2100}, "ok", [2]int{2100, 2200}}), map[string]int{}, 0},
		{"the later one recorded less than a slice before", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 1800}, "ok", [2]int{1800, 1900}},
			queueSpec{"w2", 1, "x", [2]int{1600, 1950}, "ok", [2]int{1950, 2000}}), map[string]int{}, 0},
		{"the library's slice: recorded 1.1 s before", defaultSlice(crowdHistory(
			queueSpec{"h", 2, "x", [2]int{0, 1}, "ok", [2]int{1, 2700}},
			queueSpec{"w1", 0, "x", [2]int{100, 2800}, "ok", [2]int{2800, 2900}},
			queueSpec{"w2", 1, "x", [2]int{1700, 2900}, "ok", [2]int{2900, 3000}})), map[string]int{}, 1},
		{"the library's slice: recorded 0.8 s before", defaultSlice(crowdHistory(
			queueSpec{"h", 2, "x", [2]int{0, 1}, "ok", [2]int{1, 2400}},
			queueSpec{"w1", 0, "x", [2]int{100, 2500}, "ok", [2]int{2500, 2600}},
			queueSpec{"w2", 1, "x", [2]int{1700, 2600}, "ok", [2]int{2600, 2700}})), map[string]int{}, 0},
		{"two later waits recorded before one returned: one chance", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 2900}, "ok", [2]int{2900, 3000}},
			queueSpec{"w2", 1, "x", [2]int{1600, 3100}, "ok", [2]int{3100, 3200}},
			queueSpec{"w3", 1, "x", [2]int{1700, 3300}, "ok", [2]int{3300, 3400}}), map[string]int{}, 1},
		{"overtaken by a writer that began exactly the slack later", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 2500}, "ok", [2]int{2500, 2600}},
			queueSpec{"w2", 1, "x", [2]int{1500, 2000}, "ok", [2]int{2000, 2100}}), map[string]int{VOvertaken: 1}, 1},
		{"the later one began within the slack", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 2500}, "ok", [2]int{2500, 2600}},
			queueSpec{"w2", 1, "x", [2]int{1400, 2000}, "ok", [2]int{2000, 2100}}), map[string]int{}, 0},
		{"the earlier one had given up when the later one was granted", crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 1400}, "not_acquired", [2]int{}},
			queueSpec{"w2", 1, "x", [2]int{1100, 1500}, "ok", [2]int{1500, 1600}}), map[string]int{}, 0},
		{"overtaken, a fault near the later one", evidence(crowdHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 2500}, "ok", [2]int{2500, 2600}},
			queueSpec{"w2", 1, "x", [2]int{1600, 2000}, "ok", [2]int{2000, 2100}}),
			Evidence{Kind: "cut", At: at(1800), Worker: 1}), map[string]int{}, 0},
		{"writers of the writer operation are not judged (they may share a Locker)", queueHistory(
			queueSpec{"w1", 0, "x", [2]int{0, 2000}, "ok", [2]int{2000, 2100}},
			queueSpec{"w2", 1, "x", [2]int{1100, 1500}, "ok", [2]int{1500, 1600}}), map[string]int{}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := map[string]int{}
			for _, v := range tc.h.queue() {
				got[v.Kind]++
				t.Log(v.Detail)
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("violations %v, want %v", got, tc.want)
			}
			if tc.h.OvertakeChances != tc.chances {
				t.Errorf("%d chances to overtake counted, want %d", tc.h.OvertakeChances, tc.chances)
			}
		})
	}
}

// The queue rules, each shown to fire, with the allowed cases beside them.
func TestCheckerQueue(t *testing.T) {
	with := func(h *History, f func(h *History)) *History { f(h); return h }
	for _, tc := range []struct {
		name string
		h    *History
		want map[string]int
	}{
		{"a writer granted once the readers it came behind let go, a newcomer let in meanwhile", queueHistory(
			queueSpec{"a", 1, "s", [2]int{0, 1}, "ok", [2]int{1, 800}},
			queueSpec{"b", 2, "s", [2]int{10, 11}, "ok", [2]int{11, 600}},
			queueSpec{"w", 0, "x", [2]int{100, 1500}, "ok", [2]int{1500, 1550}},
			queueSpec{"c", 1, "s", [2]int{300, 301}, "ok", [2]int{301, 1200}},
			queueSpec{"d", 2, "s", [2]int{700, 1560}, "ok", [2]int{1560, 2000}}), map[string]int{}},
		{"a writer starved by readers that came after it", starvedWriter(), map[string]int{VStarvedWait: 1}},
		{"a writer behind an earlier writer's long section", queueHistory( // granted after the later one began
			queueSpec{"w1", 1, "x", [2]int{0, 300}, "ok", [2]int{300, 4000}},
			queueSpec{"w2", 0, "x", [2]int{10, 4010}, "ok", [2]int{4010, 4050}}), map[string]int{}},
		{"a writer granted long after an earlier writer let go", queueHistory(
			queueSpec{"w1", 1, "x", [2]int{0, 300}, "ok", [2]int{300, 400}},
			queueSpec{"w2", 0, "x", [2]int{10, 4010}, "ok", [2]int{4010, 4050}}), map[string]int{VStarvedWait: 1}},
		{"a reader behind a writer that held long", queueHistory(
			queueSpec{"w", 1, "x", [2]int{0, 5}, "ok", [2]int{5, 4000}},
			queueSpec{"r", 0, "s", [2]int{100, 4100}, "ok", [2]int{4100, 4500}}), map[string]int{}},
		{"a reader granted long after the writer it came behind", queueHistory(
			queueSpec{"w", 1, "x", [2]int{0, 5}, "ok", [2]int{5, 1000}},
			queueSpec{"r", 0, "s", [2]int{100, 5200}, "ok", [2]int{5200, 5300}}), map[string]int{VStarvedWait: 1}},
		{"readers do not queue behind readers", queueHistory(
			queueSpec{"a", 1, "s", [2]int{0, 1}, "ok", [2]int{1, 8000}},
			queueSpec{"r", 0, "s", [2]int{100, 4100}, "ok", [2]int{4100, 4500}}), map[string]int{VStarvedWait: 1}},
		{"a starved writer whose readers' worker was stopped", with(starvedWriter(), func(h *History) {
			h.Pauses = []Pause{{Worker: 1, From: at(3000), To: at(5000)}}
		}), map[string]int{}},
		{"a starved writer behind a slow link", evidence(starvedWriter(),
			Evidence{Kind: "slow_link", At: at(2000), Until: at(4000), Worker: 0}), map[string]int{}},
		{"a starved writer, the server restarting", evidence(starvedWriter(),
			Evidence{Kind: "restart_fast", At: at(5000), Until: at(5600), Worker: -1}), map[string]int{}},
		{"a fault on a worker that never touched the key excuses nothing", evidence(starvedWriter(),
			Evidence{Kind: "cut", At: at(3000), Worker: 5}), map[string]int{VStarvedWait: 1}},
		{"a fault long before the wait excuses nothing", evidence(starvedWriter(),
			Evidence{Kind: "blackhole", At: at(-9000), Until: at(-8000), Worker: 0}), map[string]int{VStarvedWait: 1}},
		{"a section of a killed worker has no end: not judged", with(starvedWriter(), func(h *History) {
			h.CS["a.cs"].Ended = false
		}), map[string]int{}},
		{"a wait whose end was never recorded is not judged", with(starvedWriter(), func(h *History) {
			h.Waits[len(h.Waits)-1].End = time.Time{}
		}), map[string]int{}},

		{"a wait with no deadline that failed over a slow link", evidence(queueHistory(
			queueSpec{"w", 0, "x", [2]int{0, 1500}, "timeout", [2]int{}}),
			Evidence{Kind: "slow_link", At: at(100), Until: at(2000), Worker: 0}), map[string]int{VFailedWait: 1}},
		{"a wait with no deadline that failed with nothing near it", queueHistory(
			queueSpec{"w", 0, "s", [2]int{0, 1500}, "error", [2]int{}}), map[string]int{VFailedWait: 1}},
		{"a wait that found its Locker closed long after the close began", evidence(queueHistory(
			queueSpec{"w", 0, "s", [2]int{6000, 6000}, "closed", [2]int{}}),
			Evidence{Kind: "close_locker", At: at(0), Worker: 0}), map[string]int{}},
		{"a wait that found its Locker closed with no close", queueHistory(
			queueSpec{"w", 0, "s", [2]int{6000, 6000}, "closed", [2]int{}}), map[string]int{VFailedWait: 1}},
		{"a close of another worker's Locker excuses nothing", evidence(queueHistory(
			queueSpec{"w", 0, "s", [2]int{6000, 6000}, "closed", [2]int{}}),
			Evidence{Kind: "close_locker", At: at(0), Worker: 1}), map[string]int{VFailedWait: 1}},
		{"a wait that failed as its worker was cut off", evidence(queueHistory(
			queueSpec{"w", 0, "x", [2]int{0, 1500}, "error", [2]int{}}),
			Evidence{Kind: "cut", At: at(1400), Worker: 0}), map[string]int{}},
		{"a wait that failed as its Locker was closed", evidence(queueHistory(
			queueSpec{"w", 0, "x", [2]int{0, 1500}, "closed", [2]int{}}),
			Evidence{Kind: "close_locker", At: at(1490), Worker: 0}), map[string]int{}},
		{"a wait that failed as the server restarted", evidence(queueHistory(
			queueSpec{"w", 0, "s", [2]int{0, 1500}, "error", [2]int{}}),
			Evidence{Kind: "restart_immediate", At: at(1000), Until: at(1400), Worker: -1}), map[string]int{}},
		{"a wait that failed as another worker was cut off", evidence(queueHistory(
			queueSpec{"w", 0, "x", [2]int{0, 1500}, "error", [2]int{}}),
			Evidence{Kind: "cut", At: at(1400), Worker: 1}), map[string]int{VFailedWait: 1}},
		{"a wait bounded by Wait over a slow link, not acquired", evidence(queueHistory(
			queueSpec{"w", 0, "x", [2]int{0, 2500}, "not_acquired", [2]int{}}),
			Evidence{Kind: "slow_link", At: at(100), Until: at(2000), Worker: 0}), map[string]int{}},
	} {
		t.Run(tc.name, func(t *testing.T) { wantViolations(t, tc.h, tc.want) })
	}

	// A writer's intent is held by the session that waits for (or holds) its key: a sample drops it; an intent held
	// without its key is named after the key, for the leak rule.
	t.Run("writers' intents in pg_locks", func(t *testing.T) {
		k := canon(queueKey)
		var ik string
		for i, key := range intents {
			if key == k {
				ik = i
			}
		}
		s := Sample{At: at(0), Held: map[string][]Holder{
			ik: {{App: "w0", PID: 5, Granted: true}, {App: "w1", PID: 6, Granted: true}},
			k:  {{App: "w0", PID: 5, Granted: false}, {App: "w2", PID: 7, Granted: true}},
		}}
		foldIntents(s)
		if _, ok := s.Held[ik]; ok || len(s.Held[k]) != 2 || fmt.Sprint(s.Held["intent of "+k]) != fmt.Sprint([]Holder{{App: "w1", PID: 6, Granted: true}}) {
			t.Errorf("folded: %v", s.Held)
		}
	})
}

// wantViolations checks that the checker finds in h exactly the violations want counts, by kind.
func wantViolations(t *testing.T, h *History, want map[string]int) {
	t.Helper()
	got := map[string]int{}
	var details []string
	for _, v := range Check(h) {
		got[v.Kind]++
		details = append(details, v.Kind+": "+v.Detail)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v\n%s", got, want, strings.Join(details, "\n"))
	}
}

// A sample's tickets: a wait for the ticket in front of it is a wait for the key, a ticket of a session in the
// line or holding the key is its place, a ticket of a session that neither holds nor waits is a lock of its own.
func TestFoldTickets(t *testing.T) {
	v, _ := queueKey.Int64()
	ticket := func(seq int64) session.ID { return session.ID{V: v}.Ticket(seq) }
	if k, ok := ticketOf(ticket(3)); !ok || k != canon(queueKey) {
		t.Fatalf("ticketOf(a ticket of the queue key) = %q, %v", k, ok)
	}
	if _, ok := ticketOf(session.ID{V: v}); ok {
		t.Fatal("the queue key itself is a ticket")
	}
	q := canon(queueKey)
	s := Sample{Held: map[string][]Holder{q: {{PID: 1, Granted: true}, {PID: 2}}}}
	foldTickets(s, []ticketRow{
		{q, Holder{PID: 2, Granted: true}},  // the head: waits for the key
		{q, Holder{PID: 3, Granted: true}},  // behind it
		{q, Holder{PID: 3}},                 // waits for 2's ticket
		{q, Holder{PID: 1, Granted: true}},  // the holder, before it left the line
		{q, Holder{PID: 9, Granted: true}}}) // nobody's wait
	var pids []int32
	for _, h := range s.Held[q] {
		if !h.Granted {
			pids = append(pids, h.PID)
		}
	}
	if fmt.Sprint(pids) != "[2 3]" {
		t.Errorf("waits for the key: %v, want [2 3]", pids)
	}
	if got := s.Held["ticket of "+q]; len(got) != 1 || got[0].PID != 9 {
		t.Errorf("tickets left as locks of their own: %v, want pid 9's", got)
	}
}
