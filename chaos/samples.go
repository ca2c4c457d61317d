package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
)

// sample reads pg_locks every 100 ms.
func (c *campaign) sample(ctx context.Context) {
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if conn == nil || conn.IsClosed() {
			var err error
			if conn, err = pgx.Connect(qctx, c.primary().URL); err != nil {
				conn = nil
				cancel()
				continue
			}
		}
		s, err := c.read(qctx, conn)
		cancel()
		if err != nil {
			conn.Close(context.Background())
			conn = nil
			continue
		}
		c.mu.Lock()
		c.samples = append(c.samples, s)
		c.mu.Unlock()
	}
}

// read samples what holds the workers' keys: pg_locks, or in a lease campaign the lease table.
func (c *campaign) read(ctx context.Context, conn *pgx.Conn) (Sample, error) {
	if c.opt.Leases {
		return readLeases(ctx, conn)
	}
	return readLocks(ctx, conn)
}

// readLeases samples the leases (every row: a lease is held until it is deleted or taken over, whatever its
// expiry says on the server's clock) and the live waits for them, each under the worker it names (its holder text
// ends with the worker's name), as readLocks samples pg_locks (no pid: a lease has no session). The sample is
// stamped with this process's clock, not the server's, which may step (clock_step). Each names the process that
// holds it (Holder.PID: the pid its holder text names).
func readLeases(ctx context.Context, conn *pgx.Conn) (Sample, error) {
	at := time.Now()
	rows, err := conn.Query(ctx, `SELECT x.key, x.granted, x.holder, x.term
		FROM (SELECT 1) one LEFT JOIN (
			SELECT key, true AS granted, holder, term, NULL::timestamptz AS since FROM public.advlock_lease
			UNION ALL SELECT key, false, holder, 0, since FROM public.advlock_lease_wait AS w WHERE `+lease.LiveWait+`
		) x ON true ORDER BY x.key, x.granted DESC, x.since`) // a key's waits in the order of its queue
	if err != nil {
		return Sample{}, err
	}
	s := Sample{At: at, Held: map[string][]Holder{}}
	for rows.Next() {
		var key *int64
		var granted *bool
		var holder *string
		var term *int64
		if err := rows.Scan(&key, &granted, &holder, &term); err != nil {
			return Sample{}, err
		}
		if s.Read.IsZero() {
			s.Read = time.Now()
		}
		if key == nil {
			continue
		}
		app := *holder
		if i := strings.LastIndexByte(app, ' '); i >= 0 {
			app = app[i+1:]
		}
		var pid int32
		if _, rest, ok := strings.Cut(*holder, " pid "); ok {
			_, _ = fmt.Sscanf(rest, "%d", &pid)
		}
		k := canon(advlock.Int64Key(*key))
		s.Held[k] = append(s.Held[k], Holder{App: app, PID: pid, Granted: *granted, Term: *term})
	}
	if err := rows.Err(); err != nil {
		return Sample{}, err
	}
	if s.Read.IsZero() {
		return Sample{}, errors.New("lease sample: no row")
	}
	return s, nil
}

func readLocks(ctx context.Context, conn *pgx.Conn) (Sample, error) {
	// pg_lock_status() is read once, as the scan starts; clock_timestamp() in each row comes after it. The outer
	// join from one row gives a row (of NULLs) when nothing is held, so an empty sample has its window too.
	rows, err := conn.Query(ctx, `SELECT statement_timestamp(), clock_timestamp(), l.classid, l.objid, l.objsubid,
			l.granted, coalesce(a.application_name, ''), l.pid
		FROM (SELECT 1) one LEFT JOIN (pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid)
			ON l.locktype = 'advisory'`)
	if err != nil {
		return Sample{}, err
	}
	s := Sample{Held: map[string][]Holder{}}
	var tickets []ticketRow
	for rows.Next() {
		var at, read time.Time
		var classid, objid *uint32
		var sub *int16
		var granted *bool
		var app string
		var pid *int32
		if err := rows.Scan(&at, &read, &classid, &objid, &sub, &granted, &app, &pid); err != nil {
			return Sample{}, err
		}
		if s.At.IsZero() {
			s.At, s.Read = at, read // the first row's: the read came before it
		}
		if classid == nil || objid == nil || sub == nil || granted == nil || pid == nil {
			continue // nothing held
		}
		if key, ok := ticketOf(session.LockID(*sub == 2, *classid, *objid)); ok {
			tickets = append(tickets, ticketRow{key, Holder{App: app, PID: *pid, Granted: *granted}})
			continue
		}
		k, _ := advlock.KeyFromPgLocks(*classid, *objid, *sub)
		s.Held[canon(k)] = append(s.Held[canon(k)], Holder{App: app, PID: *pid, Granted: *granted})
	}
	if err := rows.Err(); err != nil {
		return Sample{}, err
	}
	if s.At.IsZero() {
		return Sample{}, errors.New("pg_locks sample: no row")
	}
	foldTickets(s, tickets)
	foldIntents(s)
	return s, nil
}

// ticketRow is a pg_locks row of a ticket of a key's line (see docs/locks.md, "Waits are granted in the order
// they came").
type ticketRow struct {
	key string // the key whose line it is
	h   Holder
}

// lines maps the first ticket (less its place) of each key the workers wait for to that key.
var lines = func() map[session.ID]string {
	m := map[session.ID]string{}
	for _, k := range append(workerKeys(), pairKeys...) { // all of them int8 keys
		n, _ := k.Int64()
		m[session.ID{V: n}.LineBase()] = canon(k)
	}
	return m
}()

// flags maps the flag of each key's line (held in shared mode by the writers in the line) to that key.
var flags = func() map[session.ID]string {
	m := map[session.ID]string{}
	for _, k := range append(workerKeys(), pairKeys...) {
		n, _ := k.Int64()
		m[session.ID{V: n}.Waiting()] = canon(k)
	}
	return m
}()

// ticketOf reports whether id is a ticket of the line of a key the workers take (or its door, place 0, which a
// join holds for a moment), or that line's flag, and that key.
func ticketOf(id session.ID) (string, bool) {
	if k, ok := flags[id]; ok {
		return k, true
	}
	k, ok := lines[session.ID{Pair: id.Pair, V: id.V &^ session.LineMask}]
	return k, ok
}

// foldTickets folds the tickets of the keys' lines into a sample: a session that waits for the ticket of the
// member in front of it waits for that key, and a ticket held by a session that holds or waits for its key (or waits
// in its line) is its place in that line, not a lock of its own. A ticket its session holds otherwise is named
// "ticket of KEY": held in sample after sample, a lock left behind (the leak rule).
func foldTickets(s Sample, tickets []ticketRow) {
	inLine := map[string]map[int32]bool{}
	for _, t := range tickets {
		if !t.h.Granted {
			s.Held[t.key] = append(s.Held[t.key], t.h)
			if inLine[t.key] == nil {
				inLine[t.key] = map[int32]bool{}
			}
			inLine[t.key][t.h.PID] = true
		}
	}
	for _, t := range tickets {
		if !t.h.Granted || inLine[t.key][t.h.PID] || slices.ContainsFunc(s.Held[t.key], func(k Holder) bool { return k.PID == t.h.PID }) {
			continue
		}
		s.Held["ticket of "+t.key] = append(s.Held["ticket of "+t.key], t.h)
	}
}

// intents maps the intent of each key the workers take exclusively to that key. A writer takes the key's intent (a
// lock on another int8 key) on the session that waits, when it finds the key held in shared mode or has waited a
// whole slice, and holds it across its wait and then with the key until its unlock (docs/locks.md): no section
// holds it in the workers' records.
var intents = func() map[string]string {
	m := map[string]string{}
	for _, k := range append(workerKeys(), pairKeys...) {
		n, _ := k.Int64()
		m[canon(advlock.Int64Key(session.ID{V: n}.Intent().V))] = canon(k)
	}
	return m
}()

// workerKeys lists the int8 keys the workers take.
func workerKeys() []advlock.Key {
	keys := append(slices.Clone(lockKeys), queueKey, leadKey)
	for i := range 64 * 64 { // lock_cancel's keys of each worker's own (72000 + worker*64 + i)
		keys = append(keys, advlock.Int64Key(72000+int64(i)))
	}
	return keys
}

// foldIntents drops from a sample each intent held by a backend that also holds or waits for its key there, and
// names the others "intent of KEY": an intent its writer's session holds without the key, in sample after
// sample, is a lock left behind (the leak rule), as in Inspect.
func foldIntents(s Sample) {
	for ik, key := range intents {
		rows, ok := s.Held[ik]
		if !ok {
			continue
		}
		delete(s.Held, ik)
		for _, r := range rows {
			if !slices.ContainsFunc(s.Held[key], func(k Holder) bool { return k.PID == r.PID }) {
				s.Held["intent of "+key] = append(s.Held["intent of "+key], r)
			}
		}
	}
}
