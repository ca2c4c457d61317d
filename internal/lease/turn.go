package lease

import (
	"context"
	"strconv"
	"strings"
	"time"
)

// Of the Clients that share the tables, Turns sweep at once; the others only look, once a Sweep or less, whether a turn
// is free. A turn is a row of Timelines (timeline -1 for the first, -2 for the second): its beat (since), which its
// sweeper moves on at the start of each sweep period, and every half Sweep between the pages of a long one (beatMoved:
// its value says only that it changed). A Client that sees a turn's beat unchanged for 2*Sweep on its own monotonic
// clock (read at the start and at the end of that time), or no row for it, takes the turn: it writes the beat only if
// the beat is still the one it saw, so that of the Clients that try at once, one has it. A sweeper whose beat is no
// longer the one it wrote (another took its turn) stops sweeping and forgets what it saw. A Client holds at most one
// turn; a process of several Clients (Lockers) may hold both.
//
// Nothing here decides whether a row is deleted: the sweep's rule (a row unchanged for its holder's lease length on
// the sweeper's own clock) holds whoever sweeps, and for any number of sweepers at once. So a beat that came late
// or was cut, a server clock that stood still or a turn taken from a sweeper that was only slow cost reads and
// memory for a while, not safety; and a sweeper that died leaves its turn to another within four Sweeps of the taker
// (up to one before it reads the last beat, two while it stays unchanged, one more to the next read), which starts
// its sightings afresh, while the other turn's sweeper, which has watched every row all along, deletes the dead rows
// within the bound as before. Two turns rather than one keep the bound of a dead holder's rows (a lease length and
// a Sweep) when the holder that died was one sweeper: only both sweepers gone within a few Sweeps of each other (two
// processes, or one process that held both) delays deletions, by the time the turns take to be taken and a lease
// length.
//
// A sweeper that is closed gives its turn back (deletes its row where the beat is its last one or later, beside the
// last attempts of Close, within CloseGrace), so that another takes it at its next read rather than 2*Sweep later.
//
// The cost: a read of the turns' beats a Sweep or less by each Client that does not sweep (one short statement, no
// write); a write of its beat by each sweeper, committed without a flush (a crash that takes a beat back only looks
// like a turn taken: its sweeper stops, and the turn is taken again). The rows of other Clients, and what is kept
// of them, are read and kept by two Clients instead of all of them.
const Turns = 2

// turnAfter is how long a Client sees a turn's beat unchanged before it takes the turn.
func (c *Client) turnAfter() time.Duration { return 2 * c.cfg.Sweep }

// beatText is a turn's beat as the server renders its since in UTC to the microsecond, "infinite" at either
// infinity ("-" where there is no row), compared as text: exact whatever the session's time zone, date style or
// float settings (behind a pooler, sessions differ), on every version of PostgreSQL.
const beatText = "coalesce(to_char(x.since AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US'), 'infinite')"

// beatMoved is the beat a sweeper writes: the server's clock, or a microsecond past the last beat when that clock
// stands still or went back; the server's clock after a beat at infinity or a century ahead (written by hand: no
// overflow at the end of PostgreSQL's years).
const beatMoved = "CASE WHEN isfinite(x.since) AND x.since < clock_timestamp() + interval '100 years' " +
	"THEN greatest(clock_timestamp(), x.since + interval '1 microsecond') ELSE clock_timestamp() END"

// turnLockTimeout: a turn's statement waits at most a second for its row's lock (held by a transaction that does
// not end, it fails rather than wait: the next turn is tried).
const turnLockTimeout = "set_config('lock_timeout', '1000', true)"

// turnsReadSQL reads the turns' beats: Turns of them, separated by a space.
func turnsReadSQL() string {
	var b strings.Builder
	b.WriteString("SELECT concat_ws(' '")
	for i := 1; i <= Turns; i++ {
		b.WriteString(", coalesce((SELECT " + beatText + " FROM " + Timelines + " AS x WHERE x.timeline = -" + strconv.Itoa(i) + "), '-')")
	}
	b.WriteString(")")
	return b.String()
}

// turnTakeSQL takes turn i (1 to Turns), or beats it, where its beat is still want ("-": where it has no row): it
// answers "y" and the new beat, or "n" and the beat its snapshot held (which a beat or a take at the same moment
// may have changed: the Client's next read sees what is there). Its commit waits for no flush.
func turnTakeSQL(i int, want string) string {
	cond := "false"
	if want != "-" {
		cond = beatText + " = " + quote(want)
	}
	t := strconv.Itoa(i)
	return "SELECT " + lazy + ", " + turnLockTimeout + ";\nWITH t AS (INSERT INTO " + Timelines + " AS x (timeline, since) VALUES (-" + t +
		", clock_timestamp()) ON CONFLICT (timeline) DO UPDATE SET since = " + beatMoved + " " +
		"WHERE " + cond + " RETURNING " + beatText + " AS b) " +
		"SELECT coalesce((SELECT 'y ' || t.b FROM t), 'n ' || coalesce((SELECT " + beatText + " FROM " + Timelines +
		" AS x WHERE x.timeline = -" + t + "), '-'))"
}

// turns is what a Client knows of the turns: the one it holds (0: none) and its beat as written, and for each turn
// the beat it last saw and since when, on its own clock.
type turns struct {
	mine  int
	beat  string
	seen  [Turns]string
	since [Turns]time.Time
}

// sweepTurn runs the Client's part in the turns before a sweep's read: a sweeper beats its turn; another Client
// reads the beats, and takes a turn it has seen unchanged for turnAfter (or with no row). It reports whether the
// Client sweeps now; a sweeper that lost its turn has forgotten what it saw.
func (c *Client) sweepTurn(ctx context.Context, s *sweeper) (bool, error) {
	t := &s.turns
	if t.mine != 0 {
		ok, got, err := c.takeTurn(ctx, t.mine, t.beat)
		if err != nil {
			return false, err
		}
		if ok {
			t.beat = got
			return true, nil
		}
		s.forget()
		t.saw(t.mine-1, got, time.Now())
		t.mine, t.beat = 0, ""
		c.sweepSt.turn.Store(0)
		return false, nil
	}
	txt, _, err := exec(ctx, c.pool, c.cfg.Bound, turnsReadSQL(), false)
	now := time.Now()
	if err != nil {
		return false, err
	}
	beats := strings.Fields(txt)
	if len(beats) != Turns {
		return false, nil // not a reading of ours: nothing taken
	}
	for i, b := range beats {
		t.saw(i, b, now)
	}
	var failed error
	for i := range Turns {
		if t.seen[i] != "-" && now.Sub(t.since[i]) < c.turnAfter() {
			continue
		}
		ok, got, err := c.takeTurn(ctx, i+1, t.seen[i])
		if err != nil && !rolledBack(err) {
			return false, err // it may have taken this turn: no other
		}
		if err != nil {
			if failed == nil {
				failed = err // refused (a row locked for ever, say): the next turn is tried all the same
			}
			continue
		}
		if ok {
			t.mine, t.beat = i+1, got
			c.sweepSt.turn.Store(int32(i + 1))
			if t.seen[i] != "-" {
				c.sweepSt.taken.Add(1)
			}
			return true, nil
		}
		t.saw(i, got, time.Now())
	}
	return false, failed
}

// giveTurnBack deletes the row of the turn t holds, if any, where its beat is the last the Client wrote or later
// (turnGiveBackSQL): one attempt, run as Close's last attempts are (Close waits for it within CloseGrace, then cuts
// it).
func (c *Client) giveTurnBack(t *turns) {
	if t.mine == 0 {
		return
	}
	c.sweepSt.turn.Store(0)
	sql := turnGiveBackSQL(t.mine, t.beat)
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		_, _, _ = exec(c.bgCtx, c.pool, min(c.cfg.Bound, CloseGrace), sql, false)
	}()
}

// turnGiveBackSQL deletes turn i's row where its beat is still beat, or later (a beat of the Client's cut by Close
// may have been written; a later beat of another Client that took the turn meanwhile is deleted too, which costs that
// Client its turn, nothing else): it answers how many rows it deleted (0 or 1). Its commit waits for no flush.
func turnGiveBackSQL(i int, beat string) string {
	cond := beatText + " = " + quote(beat)
	if beat != "infinite" {
		cond = "(" + cond + " OR x.since > " + quote(beat) + "::timestamp AT TIME ZONE 'UTC')"
	}
	return "SELECT " + lazy + ", " + turnLockTimeout + ";\nWITH d AS (DELETE FROM " + Timelines + " AS x WHERE x.timeline = -" +
		strconv.Itoa(i) + " AND " + cond + " RETURNING 1) SELECT count(*) FROM d"
}

// saw records that turn i's beat read b at now: since is when it was first read so.
func (t *turns) saw(i int, b string, now time.Time) {
	if t.since[i].IsZero() || t.seen[i] != b {
		t.seen[i], t.since[i] = b, now
	}
}

// takeTurn runs turnTakeSQL(i, want): whether the Client holds turn i now, and the beat it wrote or found.
func (c *Client) takeTurn(ctx context.Context, i int, want string) (bool, string, error) {
	txt, _, err := exec(ctx, c.pool, c.cfg.Bound, turnTakeSQL(i, want), false)
	if err != nil {
		return false, "", err
	}
	yn, b, _ := strings.Cut(strings.TrimSpace(txt), " ")
	return yn == "y" && b != "", b, nil
}

// SweepStats is what a Client's sweep has done so far (for tests): the turn it holds (0: none), the reads of the
// rows it has made (a page of the tables each), and the turns it has taken from another sweeper (whose beat it saw
// unchanged; a turn without a row is not counted).
type SweepStats struct {
	Turn         int
	Reads, Taken int64
}

// SweepStats reports what the Client's sweep has done so far.
func (c *Client) SweepStats() SweepStats {
	return SweepStats{Turn: int(c.sweepSt.turn.Load()), Reads: c.sweepSt.reads.Load(), Taken: c.sweepSt.taken.Load()}
}
