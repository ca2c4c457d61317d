package lease

import (
	"context"
	"math/rand/v2"
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
// Every Client whose tables exist sweeps, every Sweep (jittered): it reads the rows that look dead on the server's
// clock (a lease past its expiry, a wait not seen within WaitStale), and deletes those it has seen unchanged for
// their holder's lease length on its own monotonic clock, each keyed on the record it saw. That is the takeover's
// rule (Client.matured): the holder trusts its lease for less than its length from the send of the statement that
// made the record, so a record unchanged for that length after it was read belongs to a holder that has stopped
// trusting it, whatever the server's clock did; and a record does not come back (every grant and renewal makes the
// expiry later), so a lease granted or renewed since is not deleted. A crash may bring an older record back (it took
// back the renewals after it): one the sweep then watches anew, its holder renewing it meanwhile, and within the
// quiet period after the crash (see restartCheck). The server's clock only chooses what to watch:
// one that steps forward makes every row a candidate, and none is deleted while its holder renews it. A deleted
// lease frees its key as a takeover would, and the next grant of it is made like any other (the wait after a
// crash or a promotion included). A wait's row is deleted once it has not changed for a lease length, or 2*WaitStale when
// that is longer: a live waiter refreshes it at least once a second while it polls, and a row deleted under a waiter
// that was only held up (a pause, a partition, the wait after a crash or a promotion, whose answers refresh nothing) is
// written again at its next poll (the waiter queues anew).

// sweepMax bounds the rows of each table one sweep reads and deletes: a backlog goes at that rate.
const sweepMax = "1000"

// sweepReadSQL reads the candidates, as one text: the leases past their expiry on the server's clock ("space key
// term expiry_us length_ms" each, the holder's length from its owner, 0 when it does not say), a ';', and the
// waits not seen within WaitStale ("space key waiter seen_us" each), each list separated by ','.
const sweepReadSQL = "SELECT concat((SELECT string_agg(concat_ws(' ', l.space, l.key, l.term, (extract(epoch FROM l.expires) * 1000000)::int8, " +
	"CASE WHEN l.owner ~ '/[0-9]{1,12}$' THEN substring(l.owner FROM '/([0-9]+)$')::int8 ELSE 0 END), ',') FROM (SELECT * FROM " + Table +
	" WHERE expires < clock_timestamp() LIMIT " + sweepMax + ") AS l), ';', (SELECT string_agg(concat_ws(' ', w.space, w.key, w.waiter, " +
	"(extract(epoch FROM w.seen) * 1000000)::int8), ',') FROM (SELECT * FROM " + Waits + " AS w WHERE NOT (" + LiveWait + ") LIMIT " + sweepMax + ") AS w))"

// waitRow names a wait's row.
type waitRow struct {
	id     session.ID
	waiter string
}

// sweeper is what a Client's sweep has seen: the records of the candidates and since when (its monotonic clock).
type sweeper struct {
	leases map[session.ID]sighting
	waits  map[waitRow]sighting // rec.exp is the row's seen
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

// sweep runs the sweeps until Close: the first after half a period or so (jittered), then one every Sweep or so.
func (c *Client) sweep(ctx context.Context) {
	defer close(c.sweepDone)
	s := &sweeper{leases: map[session.ID]sighting{}, waits: map[waitRow]sighting{}}
	d := c.cfg.Sweep/4 + rand.N(c.cfg.Sweep/2+1)
	for {
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		d = c.cfg.Sweep/2 + rand.N(c.cfg.Sweep+1)
		if err := c.sweepOnce(ctx, s); err != nil {
			d *= 4 // the server or the network is failing: the sweep can wait, and takes no connection meanwhile
		}
	}
}

// sweepOnce reads the candidates and deletes those it has watched long enough. A read or delete that fails changes
// nothing: the next sweep reads again.
func (c *Client) sweepOnce(ctx context.Context, s *sweeper) error {
	txt, _, err := exec(ctx, c.pool, c.cfg.Bound, sweepReadSQL, false)
	recv := time.Now()
	if err != nil {
		return err
	}
	leasesTxt, waitsTxt, _ := strings.Cut(txt, ";")
	leases := map[session.ID]sighting{}
	var gone []string
	for _, f := range splitRows(leasesTxt, 5) {
		id, ok := parseID(f[0], f[1])
		term, err1 := strconv.ParseInt(f[2], 10, 64)
		exp, err2 := strconv.ParseInt(f[3], 10, 64)
		lenMs, err3 := strconv.ParseInt(f[4], 10, 64)
		if !ok || err1 != nil || err2 != nil || err3 != nil {
			continue
		}
		need := time.Duration(lenMs) * time.Millisecond
		if need <= 0 {
			// An owner that does not say (an earlier version's): its length may be longer than this Client's, and
			// the row's time left, which a taker watches it for instead, is gone by now. Left to its takeover.
			continue
		}
		rec := record{term, exp}
		seen, had := s.leases[id]
		if !had || seen.rec != rec {
			seen = sighting{rec: rec, first: recv, need: need}
		}
		seen.last = recv
		leases[id] = seen
		if recv.Sub(seen.first) >= seen.need || mutant.On(mutant.LeaseSweepServerExpiry) {
			gone = append(gone, "("+f[0]+","+f[1]+","+f[2]+","+f[3]+")")
		}
	}
	s.leases = leases // what was not read again has changed, or gone
	waits := map[waitRow]sighting{}
	var left []string
	for _, f := range splitRows(waitsTxt, 4) {
		id, ok := parseID(f[0], f[1])
		seenUs, err := strconv.ParseInt(f[3], 10, 64)
		if !ok || err != nil || !isHex(f[2]) {
			continue
		}
		k := waitRow{id, f[2]}
		rec := record{exp: seenUs}
		seen, had := s.waits[k]
		if !had || seen.rec != rec {
			seen = sighting{rec: rec, first: recv, need: max(c.cfg.Length, 2*WaitStale)}
		}
		seen.last = recv
		waits[k] = seen
		if recv.Sub(seen.first) >= seen.need {
			left = append(left, "("+f[0]+","+f[1]+",'"+f[2]+"',"+f[3]+")")
		}
	}
	s.waits = waits
	if len(gone) == 0 && len(left) == 0 {
		return nil
	}
	_, _, err = exec(ctx, c.pool, c.cfg.Bound, sweepDeleteSQL(gone, left), false)
	return err
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
			"WHERE l.space = v.sp AND l.key = v.k AND l.term = v.tm AND (extract(epoch FROM l.expires) * 1000000)::int8 = v.ex RETURNING 1), ")
	} else {
		b.WriteString("d AS (SELECT 1 WHERE false), ")
	}
	if len(left) > 0 {
		b.WriteString("e AS (DELETE FROM " + Waits + " AS w USING (VALUES " + strings.Join(left, ",") + ") AS v(sp, k, wt, sn) " +
			"WHERE w.space = v.sp AND w.key = v.k AND w.waiter = v.wt AND (extract(epoch FROM w.seen) * 1000000)::int8 = v.sn RETURNING 1) ")
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

// isHex reports whether s is a waiter id as newID makes them (and so safe inside a literal).
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
