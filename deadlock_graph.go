package advlock

// The wait-for graph a Locker builds from one reading of the server's lock graph (graphSQL) and its own watched
// waits, and the waits it chooses to give up (see deadlock.go).

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// lockRow is one row of graphSQL.
type lockRow struct {
	pid     uint32
	id      session.ID
	shared  bool
	granted bool
	waitFor session.Ref // from the comment: the lock it says it waits for (PID 0)
	held    []session.Ref
	tagged  bool
	line    *session.Ref // a wait for a ticket of this key's line (its comment names the key): a wait for that key
}

// key is the key and mode a wait row waits for: its own, or for a wait in a key's line that key's.
func (r lockRow) key() (session.ID, bool) {
	if r.line != nil {
		return r.line.ID, r.line.Shared
	}
	return r.id, r.shared
}

func parseGraph(s string) []lockRow {
	var rows []lockRow
	for line := range strings.SplitSeq(s, "\n") {
		f := strings.Split(line, "\t")
		if len(f) < 6 {
			continue
		}
		ref, ok := session.ParseRef(f[0] + "." + f[1] + "." + f[2] + "." + f[3] + "." + f[4])
		if !ok {
			continue
		}
		r := lockRow{pid: ref.PID, id: ref.ID, shared: ref.Shared, granted: f[5] == "g"}
		if len(f) > 6 {
			r.waitFor, r.held, r.tagged = parseComment(f[6])
			if k, ok := commentKey(f[6]); ok && !r.granted {
				if _, in := k.ID.InLine(r.id); in {
					r.line = &k
				}
			}
		}
		rows = append(rows, r)
	}
	return rows
}

// parseComment reads "w=LOCK h=REF,REF" (what watchWait writes, without "advlock "), after how long the wait had
// waited ("q=MS ", see commentWaited).
func parseComment(s string) (wait session.Ref, held []session.Ref, ok bool) {
	if _, rest, ok := strings.Cut(s, "q="); ok && strings.HasPrefix(s, "q=") {
		_, s, _ = strings.Cut(rest, " ")
	}
	w, h, found := strings.Cut(s, " h=")
	w, okW := strings.CutPrefix(w, "w=")
	if !found || !okW {
		return wait, nil, false
	}
	id, shared, okL := session.ParseLock(w)
	if !okL {
		return wait, nil, false
	}
	for r := range strings.SplitSeq(strings.TrimSpace(h), ",") {
		if ref, ok := session.ParseRef(r); ok {
			held = append(held, ref)
		}
	}
	return session.Ref{ID: id, Shared: shared}, held, true
}

// commentKey reads the key and mode a wait's comment says it waits for ("w=LOCK", or for a wait that publishes
// nothing else, "k=LOCK"): a lock of its session that is a ticket of that key's line is its place in that line.
func commentKey(s string) (session.Ref, bool) {
	for f := range strings.FieldsSeq(s) {
		if v, ok := strings.CutPrefix(f, "w="); ok {
			s = v
		} else if v, ok := strings.CutPrefix(f, "k="); ok {
			s = v
		} else {
			continue
		}
		id, shared, ok := session.ParseLock(s)
		return session.Ref{ID: id, Shared: shared}, ok
	}
	return session.Ref{}, false
}

// commentWaited reads how long a wait had waited when it sent its current statement ("q=MS", the start of what
// every wait's statement says in its comment).
func commentWaited(s string) (time.Duration, bool) {
	v, ok := strings.CutPrefix(s, "q=")
	if !ok {
		return 0, false
	}
	v, _, _ = strings.Cut(v, " ")
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil || ms < 0 {
		return 0, false
	}
	return time.Duration(ms) * time.Millisecond, true
}

// graph is a wait-for graph: each node is a wait, each edge goes to a wait whose caller holds what the first waits
// for.
type graph struct {
	nodes []*node
}

type node struct {
	// local: a wait only its own Locker sees (on its way to a session of its own); seq orders those, the youngest
	// least. Every other wait is ranked by what its caller holds (held, least first), then the key it waits for,
	// then the pid it waits on (pid; 0 for a wait of this Locker that left the server a moment ago): see less.
	local bool
	seq   int64
	// recent: a wait of this Locker that left the server a moment ago, judged among the waits every client sees
	// (the other clients' readings may show it, or may not any more).
	recent bool
	pid    uint32
	key    session.Ref // the key and mode it waits for (PID 0)
	// tagged: a wait that a Locker watches (its comment publishes what its caller holds, or it is this Locker's):
	// only such a wait can be ended, and only such a wait is chosen to give up.
	tagged bool
	held   []session.Ref // in refLess order
	out    []*node
	w      *waiter // this Locker's, or nil
	desc   string
}

type holderID struct {
	pid uint32
	id  session.ID
}

func conflicts(shared1, shared2 bool) bool { return !shared1 || !shared2 }

func keyOf(id session.ID) Key {
	if id.Pair {
		return PairKey(int32(id.V>>32), int32(id.V))
	}
	return Int64Key(id.V)
}

// localGraph builds the graph from the server's rows and this Locker's own watched waits. l.mu is held.
func (l *Locker) localGraph(s string) *graph {
	rows := parseGraph(s)
	g := &graph{}
	byPID := map[uint32]*waiter{}
	last := map[uint32][]*waiter{} // waits out of the server now, by the session they last waited on
	away := map[uint32]bool{}      // (tests) the sessions of waits read as if they had just left them
	shown := map[*waiter]bool{}    // (tests) waits read as if they had just left their session, which shows them
	for w := range l.waiters {
		if p := w.tag.PID(); p != 0 {
			if h := testHookAway.Load(); h != nil && w.ownPath && (*h)(l, w) {
				away[p] = true
				continue
			}
			if h := testHookAwayShown.Load(); h != nil && w.ownPath && (*h)(l, w) {
				last[p], shown[w] = append(last[p], w), true
				continue
			}
			byPID[p] = w
		} else if p, _, ok := w.tag.Left(); ok {
			last[p] = append(last[p], w)
		}
	}
	placed := map[*waiter]bool{} // waits matched to a row of the reading (on their session now, or on the one they left): no second node
	holders := map[session.ID][]lockRow{}
	for _, r := range rows {
		if r.granted {
			holders[r.id] = append(holders[r.id], r)
		}
	}
	var waits []lockRow
	for _, r := range rows {
		if r.granted || away[r.pid] {
			continue
		}
		if w := byPID[r.pid]; w != nil && r.line == nil {
			if _, in := w.t.ID.InLine(r.id); in { // its comment cut short: this Locker knows its key all the same
				r.line = &session.Ref{ID: w.t.ID, Shared: w.t.Shared}
			}
		}
		id, shared := r.key()
		n := &node{pid: r.pid, key: session.Ref{ID: id, Shared: shared},
			desc: fmt.Sprintf("pid %d waiting for %s", r.pid, keyOf(id))}
		// A row is a wait of this Locker's by what it waits for and what its comment says its caller holds: the
		// wait on its session now, or one that left it a moment ago (the reading, on its way as it left, shows it
		// there, maybe with another wait of this Locker on the session now): judged as every client that read it
		// there judges it, and not a second time as a wait between sessions.
		tagged := r.tagged && r.waitFor.ID == id && r.waitFor.Shared == shared
		mine := func(w *waiter) bool {
			return w.t.ID == id && w.t.Shared == shared && (!tagged || slices.Equal(sortRefs(r.held), sortRefs(w.held)))
		}
		var w *waiter
		if c := byPID[r.pid]; c != nil && mine(c) {
			w, placed[c] = c, true // not a second time below, should it leave its session meanwhile
		} else if tagged && !mutant.On(mutant.DeadlockStaleChoice) {
			for _, c := range last[r.pid] {
				if !placed[c] && mine(c) {
					w, placed[c] = c, true
					break
				}
			}
		}
		switch {
		case w != nil:
			n.w, n.held, n.tagged = w, sortRefs(w.held), true
			n.desc = fmt.Sprintf("this wait for %s (pid %d)", w.key, r.pid)
		case tagged:
			n.held, n.tagged = sortRefs(r.held), true
		}
		g.nodes = append(g.nodes, n)
		waits = append(waits, r)
	}
	// This Locker's waits on their way to a session of their own (queued for one when all are in use, waiting for
	// a connection of the pool, or checking a new one): in no server queue, they wait for their key's holders all
	// the same once they have one.
	for w := range l.waiters {
		pid, ago, ok := w.tag.Left()
		if placed[w] {
			continue
		} else if p := w.tag.PID(); away[p] || shown[w] {
			pid, ago, ok = p, 0, true
		} else if !w.ownPath || p != 0 {
			continue
		}
		n := &node{local: true, seq: w.seq, key: session.Ref{ID: w.t.ID, Shared: w.t.Shared}, held: sortRefs(w.held), w: w,
			desc: fmt.Sprintf("this wait for %s (waiting for a session to wait on)", w.key)}
		if ok && ago < deadlockRecent && !mutant.On(mutant.DeadlockStaleChoice) {
			// It waited in the server a moment ago (it gave its session up to another wait, or its slice ended):
			// other clients' readings then saw it on that session, and judged it among the waits every client
			// sees. Judged with them, ranked as they rank it, this Locker chooses what they chose; only once it has
			// been away for longer does it count as a wait only this Locker sees.
			n.local, n.recent, n.tagged, n.pid = false, true, true, pid
		}
		g.nodes = append(g.nodes, n)
		waits = append(waits, lockRow{id: w.t.ID, shared: w.t.Shared})
	}
	owners := map[holderID][]*node{}
	for _, n := range g.nodes {
		for _, h := range n.held {
			owners[holderID{h.PID, h.ID}] = append(owners[holderID{h.PID, h.ID}], n)
		}
	}
	onPID := map[uint32][]*node{} // the waits in the server, by the session that waits
	for i, r := range waits {
		if r.pid != 0 {
			onPID[r.pid] = append(onPID[r.pid], g.nodes[i])
		}
	}
	// A wait is blocked by the holders of its key in a conflicting mode, and a reader also by a writer that holds
	// the key's intent (its shared try fails, or its grant is given back, while the intent stands: in PostgreSQL's
	// own queue it would wait behind that writer). Its edges go to the waits whose callers hold those locks, and to
	// the waits of the holding sessions themselves: a session that waits (the intent's writer) lets go of nothing
	// before its own wait ends.
	for i, r := range waits {
		block := func(h lockRow, id session.ID) {
			g.nodes[i].out = append(g.nodes[i].out, owners[holderID{h.pid, id}]...)
			g.nodes[i].out = append(g.nodes[i].out, onPID[h.pid]...)
		}
		id, shared := r.key()
		for _, h := range holders[id] {
			if h.pid != r.pid && conflicts(shared, h.shared) {
				block(h, id)
			}
		}
		if r.line != nil { // and by the member in front of it in the line, whose ticket it waits for
			for _, h := range holders[r.id] {
				if h.pid != r.pid && conflicts(r.shared, h.shared) {
					block(h, r.id)
				}
			}
		}
		if shared {
			in := id.Intent()
			for _, h := range holders[in] {
				if h.pid != r.pid && !h.shared {
					block(h, in)
				}
			}
		}
	}
	return g
}

// victims chooses the waits that give up, so that no cycle is left: as few as it can, the same on every client that
// reads the same graph. In two rounds, each greedy while a cycle remains: of the waits in cycles (strongly
// connected components of more than one wait, or one that waits for its own caller), the one with the most edges
// into and out of its component (in x out: the wait most cycles pass through; a wait that every cycle shares is
// ended alone), the least (node.less) among equals, is taken out and the components are found again. The first round
// looks at the waits every client sees (those in the server's queues) and only those; the second breaks what cycles
// are left, through this Locker's waits that only it sees (on their way to a session of their own), among those
// waits alone: another client, which cannot see them, must never be counted on to end a wait for them. With one
// cycle, that is its least wait, as before.
func (g *graph) victims() map[*node]bool { return g.victimsWithout(nil) }

// victimsWithout is victims on the graph without the waits drop says (nil: none).
func (g *graph) victimsWithout(drop func(n *node) bool) map[*node]bool {
	out := map[*node]bool{}
	visible, watched := map[*node]bool{}, map[*node]bool{}
	for _, n := range g.nodes {
		if drop != nil && drop(n) {
			continue
		}
		if !n.local {
			visible[n] = true
			if n.tagged {
				watched[n] = true
			}
		}
	}
	g.greedy(visible, watched, out)
	alive := map[*node]bool{}
	local := map[*node]bool{}
	for _, n := range g.nodes {
		if !out[n] && (drop == nil || !drop(n)) {
			alive[n] = true
			if n.local {
				local[n] = true
			}
		}
	}
	g.greedy(alive, local, out)
	return out
}

// greedy adds to out, while the alive nodes still form a cycle, the pick among those of them in cycles that may
// give up (pick), as victims describes; it stops when no cycle is left or none of its waits may be picked.
func (g *graph) greedy(alive, pick map[*node]bool, out map[*node]bool) {
	for {
		comps := g.components(alive)
		if len(comps) == 0 {
			return
		}
		if mutant.On(mutant.DeadlockEveryMember) {
			for _, c := range comps {
				for _, n := range c {
					if pick[n] {
						out[n] = true
						delete(alive, n)
					}
				}
			}
			return
		}
		var best *node
		bestScore := -1
		for _, c := range comps {
			in := map[*node]bool{}
			for _, n := range c {
				in[n] = true
			}
			for _, n := range c {
				if !pick[n] {
					continue
				}
				outs, ins := 0, 0
				for _, m := range uniq(n.out) {
					if in[m] {
						outs++
					}
				}
				for _, m := range c {
					if slices.Contains(m.out, n) {
						ins++
					}
				}
				if score := outs * ins; score > bestScore || score == bestScore && n.less(best) {
					best, bestScore = n, score
				}
			}
		}
		if best == nil {
			return
		}
		out[best] = true
		delete(alive, best)
	}
}

func uniq(ns []*node) []*node {
	var out []*node
	for _, n := range ns {
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out
}

// components returns the strongly connected components of the alive nodes that contain a cycle (more than one
// node, or one with an edge to itself), each in the order of g.nodes (Tarjan's algorithm).
func (g *graph) components(alive map[*node]bool) [][]*node {
	index, low := map[*node]int{}, map[*node]int{}
	onStack := map[*node]bool{}
	var stack []*node
	var comps [][]*node
	next := 0
	var connect func(n *node)
	connect = func(n *node) {
		index[n], low[n] = next, next
		next++
		stack = append(stack, n)
		onStack[n] = true
		for _, m := range n.out {
			if !alive[m] {
				continue
			}
			if _, seen := index[m]; !seen {
				connect(m)
				low[n] = min(low[n], low[m])
			} else if onStack[m] {
				low[n] = min(low[n], index[m])
			}
		}
		if low[n] != index[n] {
			return
		}
		var c []*node
		for {
			m := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			onStack[m] = false
			c = append(c, m)
			if m == n {
				break
			}
		}
		if len(c) > 1 || slices.Contains(n.out, n) {
			order := map[*node]int{}
			for i, x := range g.nodes {
				order[x] = i
			}
			slices.SortFunc(c, func(a, b *node) int { return order[a] - order[b] })
			comps = append(comps, c)
		}
	}
	for _, n := range g.nodes {
		if _, seen := index[n]; !seen && alive[n] {
			connect(n)
		}
	}
	return comps
}

// cycleFrom returns a cycle through n, described from n, or nil.
func (g *graph) cycleFrom(n *node) []string {
	seen := map[*node]bool{}
	var path []*node
	var dfs func(m *node) bool
	dfs = func(m *node) bool {
		for _, next := range m.out {
			if next == n {
				return true
			}
			if seen[next] {
				continue
			}
			seen[next] = true
			path = append(path, next)
			if dfs(next) {
				return true
			}
			path = path[:len(path)-1]
		}
		return false
	}
	if !dfs(n) {
		return nil
	}
	out := []string{n.desc}
	for _, m := range path {
		out = append(out, m.desc)
	}
	return slices.Clip(out)
}

// less reports whether a ranks before b, the least of a cycle giving up. A wait only its own Locker sees ranks
// before every other, the youngest of them first. Every other wait is ranked by what its caller holds (the least
// lock first, then the next, a prefix before a longer list), then by the key and mode it waits for, and only then
// by the pid it waits on. What a caller holds stays on the sessions that hold it while the cycle lasts, and every
// client reads the same list (the wait's comment), so every client ranks a wait alike, whatever session the wait is
// on, or was on when a reading saw it: a wait that moves to another session (it gave its own up to another wait
// of its Locker), or a reading answered after it moved, changes no choice. The pid decides only between waits
// whose callers hold the same locks (callers that share one context).
func (a *node) less(b *node) bool {
	if a.local || b.local {
		if a.local != b.local {
			return a.local
		}
		return a.seq > b.seq
	}
	for i := range min(len(a.held), len(b.held)) {
		if a.held[i] != b.held[i] {
			return refLess(a.held[i], b.held[i])
		}
	}
	if len(a.held) != len(b.held) {
		return len(a.held) < len(b.held)
	}
	if a.key != b.key {
		return refLess(a.key, b.key)
	}
	return a.pid < b.pid
}

// sortRefs returns refs in refLess order (a copy).
func sortRefs(refs []session.Ref) []session.Ref {
	out := slices.Clone(refs)
	slices.SortFunc(out, func(a, b session.Ref) int {
		switch {
		case a == b:
			return 0
		case refLess(a, b):
			return -1
		}
		return 1
	})
	return out
}

// refLess orders locks as a wait's rank compares what its caller holds: by the holding session's pid, then the key
// (an int8 key before a pair), then the mode (exclusive first).
func refLess(a, b session.Ref) bool {
	switch {
	case a.PID != b.PID:
		return a.PID < b.PID
	case a.ID.Pair != b.ID.Pair:
		return !a.ID.Pair
	case a.ID.V != b.ID.V:
		return a.ID.V < b.ID.V
	}
	return !a.Shared && b.Shared
}
