package main

import (
	"sort"
	"time"
)

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
	h := &History{CS: map[string]*CS{}, Bound: time.Second, AppName: func(w int) string { return "w" + string(rune('0'+w)) },
		WorkerOf: func(app string) (int, bool) {
			if len(app) == 2 && app[0] == 'w' {
				return int(app[1] - '0'), true
			}
			return 0, false
		}, RunEnd: at(100_000)}
	id := int64(0)
	for _, s := range specs {
		c := &CS{ID: s.id, Worker: s.worker, Op: "lock", Key: "k", Mode: s.mode, Token: s.token, Ended: true, Clean: s.clean,
			End: at(s.writes[len(s.writes)-1] + 1)}
		if s.told >= 0 {
			c.Told, c.ToldBy = at(s.told), "done"
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

func heldAt(ms int, rows ...Holder) Sample {
	return Sample{At: at(ms), Held: map[string][]Holder{"k": rows}}
}

func evidence(h *History, e ...Evidence) *History {
	h.Evidence = append(h.Evidence, e...)
	return h
}

// onKey moves the critical section id, and its writes, to key.
func onKey(h *History, id, key string) *History {
	h.CS[id].Key = key
	for i := range h.Writes {
		if h.Writes[i].CS == id {
			h.Writes[i].Key = key
		}
	}
	return h
}

// begins sets grant times (ms) where they differ from the first write.
func begins(h *History, ms map[string]int) *History {
	for id, t := range ms {
		h.CS[id].Begin = at(t)
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
