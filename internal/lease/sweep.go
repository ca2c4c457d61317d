package lease

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/advlock/advlock/internal/mutant"
	"github.com/advlock/advlock/internal/session"
)

// The sweep deletes what the dead leave behind, so that the tables hold what is held and awaited now: the row of a
// holder that died (SIGKILL, a lost machine) stays until a grant of its key takes it over, which for a key nobody
// takes again (a per-tick or per-job key) is never; the row of a waiter that died stays for ever.
//
// The Clients that hold a turn (two at a time, see turn.go) sweep, every Sweep or less (jittered between half of it
// and all of it): each reads the rows of other Clients, all of them (its own only once they look dead on the
// server's clock: its own live ones it renews, and those it lost or gave back it deletes itself, see retire),
// sightPage of each table a read, each table once a period from where its last read stopped to its end
// (pageTables, sweepPages reads at most). It deletes each row once it has seen it unchanged for its holder's lease
// length on its own monotonic clock, keyed on the record it saw, at the moment that length has passed (not at its
// next read), provided a later read saw it unchanged too (so that the live rows of a holder whose lease is shorter than
// the time between two reads, renewed in between, cost no delete). That is the takeover's rule (Client.matured):
// the holder trusts its lease for less than its length from the send of the statement that made the record, which
// ran before the read, so a record unchanged for that length after it was read belongs to a holder that has
// stopped trusting it, whatever any clock did; and a record does not come back (every grant and renewal makes the
// expiry later), so a lease granted or renewed since is not deleted. A dead holder's row is read within a Sweep of
// its last write, again within another, and deleted its lease length after the first read: a lease length and a
// Sweep after its holder's last renewal when its length is a Sweep or more (two Sweeps when it is shorter), while
// the tables hold at most sweepPages*sightPage rows of other Clients (50,000) and a sweeper that has held its turn
// since before the holder's last renewal lives (when both die at once, the turns are taken within four Sweeps of
// the takers, and a row goes a lease length and a Sweep after that), plus the time the reads of a period take. With
// more than sweepPages pages, a row is read every k periods (k = pages/sweepPages, rounded up): a length and k Sweeps, or 2k
// Sweeps when that is longer. No clock but the sweeper's own counts: a server clock that steps
// changes nothing. A crash may bring an older record back (it took back the renewals after it), one the sweep may
// have seen before them and so delete a lease length after that sighting, while its holder may still trust a
// renewal the crash took back: the key then goes to nobody before the quiet period after the crash has passed (see
// restartCheck), by which time that trust has ended (the holder's renewals after the crash find the row gone: it
// is told). A deleted lease frees its key as a takeover would, and the next grant of it is made like any other (the
// wait after a crash or a promotion included). A wait's row is deleted once it has not changed for a lease length,
// or 2*WaitStale when that is longer: a live waiter refreshes it at least once a second while it polls, and a row
// deleted under a waiter that was only held up (a pause, a partition, the wait after a crash or a promotion, whose
// answers refresh nothing) is written again at its next poll (the waiter queues anew). A row no Client writes (a space other than
// 1 or 2, an expiry or a sighting at infinity, a waiter not in hex) is left alone.
//
// The cost, for each of the two sweepers: a read of the other Clients' rows every Sweep or less, and a sighting kept
// for each (no bound: what the tables hold); the other Clients read the turns' beats and keep nothing.

// sightPage bounds the rows of each table one read reads; sweepPages, the reads of a sweep period (one after the
// other, each on from where the last stopped); sweepMax, the rows one statement deletes.
const (
	sightPage  = 2000
	sweepPages = 25
	sweepMax   = 1000
)

// sweepReadSQL reads rows of the tables, as one text: the leases ("space key term expiry_us length_ms" each, the
// holder's length from its owner, 0 when it does not say), a ';', the waits ("space key waiter seen_us" each), each
// list in the tables' order and separated by ',', a ';' and the server's clock (microseconds). Each list starts after
// its cursor (nil: at the start) and holds at most sightPage rows: those of other Clients than the one whose id is
// own, and its own that look dead on the server's clock. A waiter that is not a hex id (not one of ours) is left out,
// and so is a row whose time is one no Locker writes (farExp: infinity, a year past 9999, written by hand), which
// holds its key until someone deletes it. A table not to be read (leases or waits false) gives an empty list.
func sweepReadSQL(own string, leaseFrom *session.ID, waitFrom *waitRow, leases, waits bool) string {
	page, leasePage, waitPage := strconv.Itoa(sightPage), "0", "0"
	if leases {
		leasePage = page
	}
	if waits {
		waitPage = page
	}
	var b strings.Builder
	b.WriteString("SELECT concat((SELECT string_agg(concat_ws(' ', l.space, l.key, l.term, (extract(epoch FROM l.expires) * 1000000)::int8, " +
		"CASE WHEN l.owner ~ '/[0-9]{1,12}$' THEN substring(l.owner FROM '/([0-9]+)$')::int8 ELSE 0 END), ',' ORDER BY l.space, l.key) FROM (SELECT * FROM " +
		Table + " AS l WHERE l.space IN (1, 2) AND NOT (" + far("l.expires") + ") AND (left(l.owner, 16) <> '" + own + "' OR l.expires < clock_timestamp())")
	if leaseFrom != nil {
		b.WriteString(" AND (l.space, l.key) > (" + space(*leaseFrom) + ", " + strconv.FormatInt(leaseFrom.V, 10) + ")")
	}
	b.WriteString(" ORDER BY l.space, l.key LIMIT " + leasePage + ") AS l), ';', (SELECT string_agg(concat_ws(' ', w.space, w.key, w.waiter, " +
		"(extract(epoch FROM w.seen) * 1000000)::int8), ',' ORDER BY w.space, w.key, w.waiter COLLATE \"C\") FROM (SELECT * FROM " + Waits +
		" AS w WHERE w.space IN (1, 2) AND NOT (" + far("w.seen") + ") AND w.waiter ~ '^[0-9a-f]{1,64}$' AND (left(w.waiter, 16) <> '" + own + "' OR NOT (" + LiveWait + "))")
	if waitFrom != nil {
		b.WriteString(" AND (w.space, w.key, w.waiter COLLATE \"C\") > (" + space(waitFrom.id) + ", " +
			strconv.FormatInt(waitFrom.id.V, 10) + ", '" + waitFrom.waiter + "')")
	}
	b.WriteString(" ORDER BY w.space, w.key, w.waiter COLLATE \"C\" LIMIT " + waitPage + ") AS w), ';', " +
		"(extract(epoch FROM clock_timestamp()) * 1000000)::int8)")
	return b.String()
}

// waitRow names a wait's row.
type waitRow struct {
	id     session.ID
	waiter string
}

func idLess(a, b session.ID) bool { return !a.Pair && b.Pair || a.Pair == b.Pair && a.V < b.V }

func waitLess(a, b waitRow) bool { return idLess(a.id, b.id) || a.id == b.id && a.waiter < b.waiter }

func cmpBy[K any](less func(a, b K) bool, a, b K) int {
	switch {
	case less(a, b):
		return -1
	case less(b, a):
		return 1
	}
	return 0
}

// sweeper is what a Client's sweep has seen: the records of the rows read and since when (its monotonic clock), and
// where the next read of each table starts.
type sweeper struct {
	leases    map[session.ID]sighting
	waits     map[waitRow]sighting // rec.exp is the row's seen
	leaseFrom *session.ID
	waitFrom  *waitRow
	turns     turns // the turn it holds, if any, and the beats it has seen (turn.go)
}

// forget forgets what the sweeper has seen of the rows (its turn was taken): the next sweeper starts afresh.
func (s *sweeper) forget() {
	s.leases, s.waits = map[session.ID]sighting{}, map[waitRow]sighting{}
	s.leaseFrom, s.waitFrom = nil, nil
}

// startSweep starts the Client's sweep, once; Close stops it.
func (c *Client) startSweep() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sweeping || c.closed || c.cfg.Sweep <= 0 {
		return
	}
	c.sweeping = true
	c.sweepDone = make(chan struct{})
	var ctx context.Context
	ctx, c.sweepStop = context.WithCancel(context.Background())
	go c.sweep(ctx)
}

// sweep runs the sweeps until Close: the first read after half a period or so (jittered), then one every Sweep or
// less; between them, it wakes when a row it watches has been unchanged for long enough, and deletes it.
func (c *Client) sweep(ctx context.Context) {
	defer close(c.sweepDone)
	s := &sweeper{}
	s.forget()
	nextRead := time.Now().Add(c.cfg.Sweep/4 + rand.N(c.cfg.Sweep/2+1))
	failing := false // the last statement failed: nothing before the next read
	for {
		wake := nextRead
		if m, ok := s.nextMaturity(); ok && !failing && m.Before(wake) {
			wake = m
		}
		t := time.NewTimer(time.Until(wake))
		select {
		case <-ctx.Done():
			t.Stop()
			c.giveTurnBack(&s.turns)
			return
		case <-t.C:
		}
		failing = false
		if !time.Now().Before(nextRead) {
			sweeps, err := c.sweepTurn(ctx, s)
			if err == nil && sweeps {
				beatAt := time.Now()
				err = pageTables(func(leases, waits bool) (bool, bool, error) {
					err := c.sweepRead(ctx, s, leases, waits)
					return s.leaseFrom != nil, s.waitFrom != nil, err
				}, func() bool { return time.Since(beatAt) >= c.cfg.Sweep/2 }, func() (bool, error) {
					beatAt = time.Now()
					return c.sweepTurn(ctx, s)
				})
			}
			nextRead = time.Now().Add(c.cfg.Sweep/2 + rand.N(c.cfg.Sweep/2+1))
			if err != nil {
				// The server or the network is failing: the sweep can wait, and takes no connection meanwhile.
				nextRead, failing = time.Now().Add(4*c.cfg.Sweep), true
				continue
			}
		}
		if err := c.sweepDelete(ctx, s, time.Now()); err != nil {
			nextRead, failing = time.Now().Add(4*c.cfg.Sweep), true
		}
	}
}

// pageTables runs a sweep period's reads: each table from where its last read stopped to its end, a page a read
// (read: of the tables asked for; it reports which it left mid-table), at most sweepPages reads, so that each row is
// read once a period however many the tables hold (up to sweepPages*sightPage rows of each), and a table of fewer
// pages than the other is not read again meanwhile. A long period beats its turn between pages once beatDue (every
// half Sweep), so that it does not look dead, and stops when the turn was taken (beat false: the sweeper has
// forgotten what it saw).
func pageTables(read func(leases, waits bool) (moreLeases, moreWaits bool, err error), beatDue func() bool,
	beat func() (bool, error)) error {
	leasesLeft, waitsLeft := true, true
	for page := 0; page < sweepPages && (leasesLeft || waitsLeft); page++ {
		if page > 0 && beatDue() {
			if ok, err := beat(); err != nil || !ok {
				return err
			}
		}
		moreLeases, moreWaits, err := read(leasesLeft, waitsLeft)
		if err != nil {
			return err
		}
		leasesLeft, waitsLeft = leasesLeft && moreLeases, waitsLeft && moreWaits
	}
	return nil
}

// sweepRead reads the next page of the leases and of the waits (of those it is asked to read) and records what it
// saw. A read that fails changes nothing.
func (c *Client) sweepRead(ctx context.Context, s *sweeper, readLeases, readWaits bool) error {
	txt, _, err := exec(ctx, c.pool, c.cfg.Bound, sweepReadSQL(c.id, s.leaseFrom, s.waitFrom, readLeases, readWaits), false)
	recv := time.Now()
	if err != nil {
		return err
	}
	c.sweepSt.reads.Add(1)
	leasesTxt, rest, _ := strings.Cut(txt, ";")
	waitsTxt, srvTxt, _ := strings.Cut(rest, ";")
	srv, _ := strconv.ParseInt(srvTxt, 10, 64)

	rows := splitRows(leasesTxt, 5)
	leases := make([]sight[session.ID], 0, len(rows))
	for _, f := range rows {
		id, ok := parseID(f[0], f[1])
		term, err1 := strconv.ParseInt(f[2], 10, 64)
		exp, err2 := strconv.ParseInt(f[3], 10, 64)
		lenMs, err3 := strconv.ParseInt(f[4], 10, 64)
		if !ok || err1 != nil || err2 != nil || err3 != nil {
			continue
		}
		// An owner that does not say its length (an earlier version's, need 0) is not watched: its length may be
		// longer than this Client's, and the row's time left, which a taker watches it for instead, is gone by now.
		// Left to its takeover.
		x := sight[session.ID]{id, record{term, exp}, time.Duration(lenMs) * time.Millisecond}
		if mutant.On(mutant.LeaseSweepServerExpiry) && x.need > 0 && exp < srv {
			x.need = time.Nanosecond // deleted once its expiry has passed on the server's clock
		}
		leases = append(leases, x)
	}
	if readLeases {
		watch(s.leases, &s.leaseFrom, idLess, leases, len(rows) >= sightPage, recv)
	}

	rows = splitRows(waitsTxt, 4)
	waits := make([]sight[waitRow], 0, len(rows))
	for _, f := range rows {
		id, ok := parseID(f[0], f[1])
		seenUs, err := strconv.ParseInt(f[3], 10, 64)
		if !ok || err != nil || !isHex(f[2]) {
			continue
		}
		waits = append(waits, sight[waitRow]{waitRow{id, f[2]}, record{exp: seenUs}, max(c.cfg.Length, 2*WaitStale)})
	}
	if readWaits {
		watch(s.waits, &s.waitFrom, waitLess, waits, len(rows) >= sightPage, recv)
	}
	return nil
}

// sight is a row a read found: its record, and how long it must stay unchanged before it is deleted (0: never).
type sight[K comparable] struct {
	k    K
	rec  record
	need time.Duration
}

// watch records in m what a read of one table found at recv, starting after *from (nil: at the start) in the
// table's order (less): a record not seen before is watched from recv; one the read's range held and it did not
// find has changed or gone, and is forgotten. A full read ends its range at its last row, where the next starts;
// else the range runs to the end of the table, and the next read starts at the start.
func watch[K comparable](m map[K]sighting, from **K, less func(a, b K) bool, got []sight[K], full bool, recv time.Time) {
	found := make(map[K]bool, len(got))
	var last K
	for i, x := range got {
		if i == 0 || less(last, x.k) {
			last = x.k
		}
		found[x.k] = true
		if x.need <= 0 {
			delete(m, x.k)
			continue
		}
		if seen, had := m[x.k]; !had || seen.rec != x.rec {
			m[x.k] = sighting{rec: x.rec, first: recv, need: x.need}
		} else {
			seen.again = recv.Sub(seen.first)  // seen again unchanged: it is due at first+need
			seen.need = min(seen.need, x.need) // the same record says the same length: only a mutant's is shorter
			m[x.k] = seen
		}
	}
	for k := range m {
		if !found[k] && (*from == nil || less(**from, k)) && (!full || len(got) == 0 || !less(last, k)) {
			delete(m, k)
		}
	}
	*from = nil
	if full && len(got) > 0 {
		*from = &last
	}
}

// due reports when a row the sweeper watches may be deleted: once it has been unchanged for its need since the read
// that first saw it, and a later read has seen it unchanged (a row whose holder renews it between two reads, a
// live one whose lease is shorter than the time between them, costs no delete). ok is false before that read.
func due(x sighting) (at time.Time, ok bool) {
	if x.again <= 0 && x.need > time.Nanosecond { // a need of 1 ns: the mutant's, which does not wait
		return time.Time{}, false
	}
	return x.first.Add(x.need), true
}

// nextMaturity is the earliest moment a row the sweeper watches is due.
func (s *sweeper) nextMaturity() (time.Time, bool) {
	var m time.Time
	ok := false
	for _, x := range s.leases {
		if t, d := due(x); d && (!ok || t.Before(m)) {
			m, ok = t, true
		}
	}
	for _, x := range s.waits {
		if t, d := due(x); d && (!ok || t.Before(m)) {
			m, ok = t, true
		}
	}
	return m, ok
}

// sweepDelete deletes the rows watched long enough by now (up to sweepMax of each table), each only while it is
// still the record seen, and forgets them. A delete that fails changes nothing: the next wake tries again.
func (c *Client) sweepDelete(ctx context.Context, s *sweeper, now time.Time) error {
	var gone []session.ID
	var left []waitRow
	for id, x := range s.leases {
		if t, d := due(x); d && len(gone) < sweepMax && !now.Before(t) {
			gone = append(gone, id)
		}
	}
	for k, x := range s.waits {
		if t, d := due(x); d && len(left) < sweepMax && !now.Before(t) {
			left = append(left, k)
		}
	}
	if len(gone) == 0 && len(left) == 0 {
		return nil
	}
	// In the tables' order, as every sweeper deletes: two that delete the same rows at once lock them in one order.
	slices.SortFunc(gone, func(a, b session.ID) int { return cmpBy(idLess, a, b) })
	slices.SortFunc(left, func(a, b waitRow) int { return cmpBy(waitLess, a, b) })
	var goneTxt, leftTxt []string
	for _, id := range gone {
		x := s.leases[id]
		goneTxt = append(goneTxt, "("+space(id)+","+strconv.FormatInt(id.V, 10)+","+
			strconv.FormatInt(x.rec.term, 10)+","+strconv.FormatInt(x.rec.exp, 10)+")")
	}
	for _, k := range left {
		leftTxt = append(leftTxt, "("+space(k.id)+","+strconv.FormatInt(k.id.V, 10)+",'"+k.waiter+"',"+
			strconv.FormatInt(s.waits[k].rec.exp, 10)+")")
	}
	if _, _, err := exec(ctx, c.pool, c.cfg.Bound, sweepDeleteSQL(goneTxt, leftTxt), false); err != nil {
		return err
	}
	for _, id := range gone {
		delete(s.leases, id)
	}
	for _, k := range left {
		delete(s.waits, k)
	}
	return nil
}

// sweepDeleteSQL deletes the leases gone ("(space,key,term,expiry_us)" each) and the waits left
// ("(space,key,'waiter',seen_us)" each), each only while its row is still the record read. It waits for a row lock
// at most 1 s (a takeover of the row holds it for a moment; a transaction that holds it longer is not waited for),
// and its commit waits for no flush and no standby: a crash that takes the delete back brings back a dead row,
// which the next sweep deletes again (a grant made after the delete and kept by the crash came after it in the WAL,
// which the server keeps as a prefix: the delete was kept too).
func sweepDeleteSQL(gone, left []string) string {
	var b strings.Builder
	b.WriteString("SELECT set_config('lock_timeout', '1000', true), set_config('synchronous_commit', 'off', true);\nWITH ")
	if len(gone) > 0 {
		b.WriteString("d AS (DELETE FROM " + Table + " AS l USING (VALUES " + strings.Join(gone, ",") + ") AS v(sp, k, tm, ex) " +
			"WHERE l.space = v.sp AND l.key = v.k AND l.term = v.tm AND l.expires = 'epoch'::timestamptz + v.ex * interval '1 microsecond' RETURNING 1), ")
	} else {
		b.WriteString("d AS (SELECT 1 WHERE false), ")
	}
	if len(left) > 0 {
		b.WriteString("e AS (DELETE FROM " + Waits + " AS w USING (VALUES " + strings.Join(left, ",") + ") AS v(sp, k, wt, sn) " +
			"WHERE w.space = v.sp AND w.key = v.k AND w.waiter = v.wt AND w.seen = 'epoch'::timestamptz + v.sn * interval '1 microsecond' RETURNING 1) ")
	} else {
		b.WriteString("e AS (SELECT 1 WHERE false) ")
	}
	b.WriteString("SELECT (SELECT count(*) FROM d) || ' ' || (SELECT count(*) FROM e)")
	return b.String()
}

// splitRows splits a list of the sweep's read into rows of n fields, leaving out any that has not n.
func splitRows(s string, n int) [][]string {
	var out [][]string
	for _, r := range strings.Split(s, ",") {
		if f := strings.Fields(r); len(f) == n {
			out = append(out, f)
		}
	}
	return out
}

// parseID reads a row's space and key.
func parseID(space, key string) (session.ID, bool) {
	v, err := strconv.ParseInt(key, 10, 64)
	if err != nil || (space != "1" && space != "2") {
		return session.ID{}, false
	}
	return session.ID{Pair: space == "2", V: v}, true
}

// isHex reports whether s is a waiter id as newWaiter makes them (and so safe inside a literal).
func isHex(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, r := range s {
		if !('0' <= r && r <= '9' || 'a' <= r && r <= 'f') {
			return false
		}
	}
	return true
}
