package main

import (
	"fmt"
	"sort"
	"time"
)

// Write is one attempt on the protected resource, as the ledger recorded it with the server's clock. Only
// committed rows exist: a transaction lock's writes that rolled back never happened.
type Write struct {
	ID       int64
	Key      string
	Token    int64
	CS       string
	Worker   int
	Mode     string // x: a fenced write; s: a shared holder's read
	Accepted *bool  // nil for reads
	At       time.Time
}

// CS is one critical section: a grant and what its holder was told.
type CS struct {
	ID     string
	Worker int
	Op     string
	Key    string
	Mode   string
	Token  int64
	Ended  bool      // its end was recorded (a SIGKILLed worker records none)
	Told   time.Time // when the library said the lock ended (Done, fn's ctx); zero if never
	Cause  string
	Unlock string
	Clean  bool // never told of an end, and the release was confirmed
	Writes []Write
}

// Holder is one row of a pg_locks sample.
type Holder struct {
	App     string
	PID     int32
	Granted bool
}

// Sample is pg_locks at one moment (server clock), advisory rows only.
type Sample struct {
	At   time.Time
	Held map[string][]Holder // Key.String() -> rows
}

// Pause is a span in which a worker was stopped (SIGSTOP to SIGCONT).
type Pause struct {
	Worker   int
	From, To time.Time
}

// History is everything the checker reads.
type History struct {
	CS       map[string]*CS
	Writes   []Write
	Samples  []Sample
	Pauses   []Pause
	Leaked   []string    // advisory locks left after the workers stopped
	Problems []Violation // worker panics, goroutine leaks, hangs, unexpected deaths
	Bound    time.Duration
	SemKeys  map[string]bool
	SemN     int
	AppName  func(worker int) string

	// Filled in by Check: how much it compared (a check that compared nothing proves nothing).
	Confirmed      int // (sample, holder) pairs where pg_locks showed the believing holder
	LateOverlaps   int // overlaps with a holder that had lost its lock, within the detection bound
	PausedOverlaps int // overlaps with a paused holder, left to the fencing rules
}

// Violation is one broken guarantee.
type Violation struct {
	Kind   string `json:"kind"`
	Detail string `json:"detail"`
}

// Violation kinds.
const (
	VOverlap    = "overlap"     // two holders of one key at once, neither told of a loss (beyond the bound)
	VStaleToken = "stale_token" // the resource accepted a token not greater than one it accepted before
	VTokenOrder = "token_order" // a later grant's token not greater than an earlier one's; a clean holder refused
	VPhantom    = "phantom"     // a holder that believed it held while pg_locks showed it did not
	VSemaphore  = "semaphore"   // more than n semaphore holders at once
	VLeak       = "leak"        // an advisory lock left behind
	VPanic      = "panic"
	VGoroutines = "goroutine_leak"
	VHang       = "hang"
	VDied       = "worker_died"
)

// believing returns the writes a holder made before it was told the lock ended.
func (c *CS) believing() []Write {
	if c.Told.IsZero() {
		return c.Writes
	}
	var out []Write
	for _, w := range c.Writes {
		if w.At.Before(c.Told) {
			out = append(out, w)
		}
	}
	return out
}

func (h *History) paused(worker int, from, to time.Time) bool {
	for _, p := range h.Pauses {
		if p.Worker == worker && p.From.Before(to) && p.To.After(from) {
			return true
		}
	}
	return false
}

// Check reads the history and returns every violation found.
func Check(h *History) []Violation {
	var out []Violation
	add := func(kind, f string, a ...any) { out = append(out, Violation{kind, fmt.Sprintf(f, a...)}) }

	for _, w := range h.Writes {
		if c := h.CS[w.CS]; c != nil {
			c.Writes = append(c.Writes, w)
		}
	}
	byKey := map[string][]*CS{}
	for _, c := range h.CS {
		sort.Slice(c.Writes, func(i, j int) bool { return c.Writes[i].ID < c.Writes[j].ID })
		if len(c.believing()) > 0 {
			byKey[c.Key] = append(byKey[c.Key], c)
		}
	}
	keys := make([]string, 0, len(byKey))
	for k := range byKey {
		keys = append(keys, k)
	}
	sort.Strings(keys)

	// Overlap: two holders of a key (not both shared) whose believing writes interleave. Two clean holders
	// (each released cleanly, never told of an end) can never overlap. Otherwise one of them must be a late
	// writer: it lost the lock before the other's grant and wrote on until told, which is allowed for the
	// detection bound past the other's first write. The late writer is the one not clean, or, when neither is,
	// the one with the smaller token (granted first); a paused late writer is left to the fencing rules.
	for _, k := range keys {
		list := byKey[k]
		sort.Slice(list, func(i, j int) bool { return list[i].believing()[0].At.Before(list[j].believing()[0].At) })
		for i, a := range list {
			ab := a.believing()
			lastA := ab[len(ab)-1].At
			for _, b := range list[i+1:] {
				bb := b.believing()
				if !bb[0].At.Before(lastA) {
					break // sorted by first write: no later one overlaps a either
				}
				if a.Mode == "s" && b.Mode == "s" {
					continue
				}
				if a.Clean && b.Clean {
					add(VOverlap, "key %s: %s %s (token %d) and %s %s (token %d) both held it, both released cleanly: %s-%s and %s-%s",
						k, a.Op, a.ID, a.Token, b.Op, b.ID, b.Token, ts(ab[0].At), ts(lastA), ts(bb[0].At), ts(bb[len(bb)-1].At))
					continue
				}
				late, other := a, b
				switch {
				case a.Clean:
					late, other = b, a
				case b.Clean:
				case b.Token < a.Token:
					late, other = b, a
				}
				lw, ow := late.believing(), other.believing()
				over := lw[len(lw)-1].At.Sub(ow[0].At)
				if over <= 0 {
					continue
				}
				if h.paused(late.Worker, ow[0].At.Add(-h.Bound), lw[len(lw)-1].At) {
					h.PausedOverlaps++
					continue
				}
				if over <= h.Bound {
					h.LateOverlaps++
					continue
				}
				add(VOverlap, "key %s: %s %s (token %d, told %s) still wrote at %s, %v after %s %s (token %d) began",
					k, late.Op, late.ID, late.Token, tsOr(late.Told), ts(lw[len(lw)-1].At), over.Round(time.Millisecond),
					other.Op, other.ID, other.Token)
			}
		}
	}

	// The resource: accepted fenced writes per key never go back, and one token belongs to one grant.
	type acc struct {
		token int64
		cs    string
	}
	last := map[string]acc{}
	writes := append([]Write(nil), h.Writes...)
	sort.Slice(writes, func(i, j int) bool { return writes[i].ID < writes[j].ID })
	for _, w := range writes {
		if w.Accepted == nil || !*w.Accepted {
			continue
		}
		p, ok := last[w.Key]
		if ok && (w.Token < p.token || w.Token == p.token && w.CS != p.cs) {
			add(VStaleToken, "key %s: write %d by %s with token %d accepted after token %d of %s", w.Key, w.ID, w.CS, w.Token, p.token, p.cs)
		}
		if !ok || w.Token >= p.token {
			last[w.Key] = acc{w.Token, w.CS}
		}
	}

	// Tokens follow grants: a clean holder's token is greater than the token of every holder whose writes all
	// came before its own first one, and a clean exclusive holder is never refused.
	for _, k := range keys {
		list := byKey[k]
		byLast := append([]*CS(nil), list...)
		sort.Slice(byLast, func(i, j int) bool { return lastWrite(byLast[i]).Before(lastWrite(byLast[j])) })
		var maxAll, maxX *CS
		j := 0
		for _, b := range list { // sorted by first believing write
			bFirst := b.believing()[0].At
			for ; j < len(byLast) && lastWrite(byLast[j]).Before(bFirst); j++ {
				a := byLast[j]
				if maxAll == nil || a.Token > maxAll.Token {
					maxAll = a
				}
				if a.Mode == "x" && (maxX == nil || a.Token > maxX.Token) {
					maxX = a
				}
			}
			if !b.Clean {
				continue
			}
			prev := maxAll
			if b.Mode == "s" {
				prev = maxX
			}
			if prev != nil && prev != b && prev.Token >= b.Token {
				add(VTokenOrder, "key %s: %s %s got token %d, not greater than token %d of %s %s, which ended before it began",
					k, b.Op, b.ID, b.Token, prev.Token, prev.Op, prev.ID)
			}
			if b.Mode == "x" {
				for _, w := range b.Writes {
					if w.Accepted != nil && !*w.Accepted {
						add(VTokenOrder, "key %s: %s %s (token %d) held the lock throughout and was refused at %s",
							k, b.Op, b.ID, b.Token, ts(w.At))
						break
					}
				}
			}
		}
	}

	// pg_locks: while a holder believes it holds, the server shows its session holding the key.
	if h.AppName != nil {
		var all []*CS
		for _, k := range keys {
			all = append(all, byKey[k]...)
		}
		const margin = 20 * time.Millisecond
		for _, s := range h.Samples {
			for _, c := range all {
				bw := c.believing()
				first, lastW := bw[0].At, bw[len(bw)-1].At
				if !first.Before(s.At.Add(-margin)) || !lastW.After(s.At.Add(margin)) {
					continue
				}
				held := false
				for _, r := range s.Held[c.Key] {
					if r.Granted && r.App == h.AppName(c.Worker) {
						held = true
					}
				}
				if held {
					h.Confirmed++
					continue
				}
				if c.Clean || lastW.Sub(s.At) > h.Bound && !h.paused(c.Worker, s.At, lastW) {
					add(VPhantom, "key %s: %s %s believed it held at %s (wrote until %s) but pg_locks showed no such holder",
						c.Key, c.Op, c.ID, ts(s.At), ts(lastW))
				}
			}
		}
	}

	// The semaphore, by slot and by operation: every holder a Semaphore hands out holds one of its n slots (a key
	// of another slot, n or above, is a violation at once), and never more than n clean holders' sections at once,
	// whatever keys they hold.
	if h.SemN > 0 {
		type edge struct {
			at time.Time
			d  int
		}
		var edges []edge
		ids := make([]string, 0, len(h.CS))
		for id := range h.CS {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		for _, id := range ids {
			c := h.CS[id]
			if c.Op != "semaphore" {
				continue
			}
			if !h.SemKeys[c.Key] {
				add(VSemaphore, "%s %s holds key %s, none of the semaphore's %d slots", c.Op, c.ID, c.Key, h.SemN)
				continue
			}
			if bw := c.believing(); c.Clean && len(bw) > 0 {
				edges = append(edges, edge{bw[0].At, 1}, edge{bw[len(bw)-1].At, -1})
			}
		}
		sort.Slice(edges, func(i, j int) bool {
			if edges[i].at.Equal(edges[j].at) {
				return edges[i].d < edges[j].d
			}
			return edges[i].at.Before(edges[j].at)
		})
		n := 0
		for _, e := range edges {
			n += e.d
			if n > h.SemN {
				add(VSemaphore, "%d semaphore holders at %s (n=%d)", n, ts(e.at), h.SemN)
				break
			}
		}
	}

	for _, l := range h.Leaked {
		add(VLeak, "%s", l)
	}
	return append(out, h.Problems...)
}

func lastWrite(c *CS) time.Time {
	if len(c.Writes) == 0 {
		return time.Time{}
	}
	return c.Writes[len(c.Writes)-1].At
}

func ts(t time.Time) string { return t.Format("15:04:05.000000") }

func tsOr(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return ts(t)
}
