package session

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Operations of the mux statement. The pair variants add 4.
const (
	opTry = iota + 1
	opTryShared
	opUnlock
	opUnlockShared
	opPair = 4
	// opLinger takes a lock's marker (a shared try of ID.Linger, its key): Confirm's round trip, whose answer also
	// proves the session still there. Not a try of the caller's key: its failure ends no lock. opLingerPair takes
	// a pair's marker (a pair too).
	opLinger     = 2*opPair + 1
	opLingerPair = opLinger + 1
)

// isTry reports whether op takes a caller's lock (the others release one, or take a marker).
func isTry(op int16) bool { return op < opLinger && (op-1)%opPair < opUnlock-1 }

// lingerOp is the operation that takes the marker of a key of t's space.
func lingerOp(pair bool) int16 {
	if pair {
		return opLingerPair
	}
	return opLinger
}

// unlockSharedOp is the operation that gives back a shared hold of a key of a space (a marker's, or a reader's).
func unlockSharedOp(pair bool) int16 {
	if pair {
		return opUnlockShared + opPair
	}
	return opUnlockShared
}

// undoOf is the request that gives back what r may have taken: an unlock of its key in its mode.
func undoOf(r *req) *req {
	if r.op >= opLinger {
		return &req{op: unlockSharedOp(r.op == opLingerPair), key: r.key}
	}
	return &req{op: r.op + opUnlock - opTry, key: r.key}
}

// The statements of a shared session, [fenced]: the array statement for a round trip of several requests, and for a
// round trip that carries one request (the usual case for a lone caller) a plain call, which costs the server
// about 20 µs less. muxSQL answers each (op, key) with its position and 1 or 0 (with fencing, a granted try
// answers its token instead of 1: the token is drawn in the branch that granted, after the grant). Pairs travel
// as one int8: high 32 bits, low 32 bits, each a signed int4 (the shifts are arithmetic).
var (
	muxStmt    = [2]string{"advlock_mux_1", "advlock_muxf_1"}
	muxSQL     [2]string
	singleSQL  [2][opLingerPair]string // by op-1
	singleStmt [2][opLingerPair]string
)

func init() {
	keys := [2]string{"t.k", "(t.k >> 32)::int4, (t.k << 32 >> 32)::int4"}
	single := [2]string{"$1::int8", "($1::int8 >> 32)::int4, ($1::int8 << 32 >> 32)::int4"}
	for f := range 2 {
		fenced := f == 1
		var cases strings.Builder
		for op := int16(1); op <= 8; op++ {
			pair, kind := (op-1)/opPair, (op-1)%opPair // kind: try, try shared, unlock, unlock shared
			shared, try := kind%2 == 1, kind < 2
			call := func(args, intent string) string {
				switch {
				case !try:
					return unlockFn(shared, args) + "::int"
				case shared:
					return sharedTry(fenced, args, intent)
				}
				return exclusiveTry(fenced, args, intent) // intent: here the key's line's flag
			}
			fmt.Fprintf(&cases, " WHEN %d THEN %s\n", op, call(keys[pair], derivedArgs(pair == 1, "t.x")))
			singleSQL[f][op-1] = "SELECT " + call(single[pair], derivedArgs(pair == 1, "$2::int8"))
			singleStmt[f][op-1] = fmt.Sprintf("%s_%d", muxStmt[f], op)
		}
		for pair, op := range []int16{opLinger, opLingerPair} {
			fmt.Fprintf(&cases, " WHEN %d THEN pg_try_advisory_lock_shared(%s)::int\n", op, keys[pair])
			singleSQL[f][op-1] = LingerSQL(pair == 1)
			singleStmt[f][op-1] = fmt.Sprintf("%s_%d", muxStmt[f], op)
		}
		muxSQL[f] = "SELECT t.i, CASE t.op\n" + cases.String() +
			" END FROM unnest($1::int2[], $2::int8[], $3::int8[]) WITH ORDINALITY AS t(op, k, x, i)"
	}
}

// isSharedTry reports whether op is a shared try, whose statement also takes the key's intent as an argument.
func isSharedTry(op int16) bool { return op < opLinger && (op-1)%opPair == opTryShared-1 }

// isGatedTry reports whether op is a try whose statement takes a second key that may refuse it: a shared try the
// key's intent, an exclusive one the key's line's flag (see Waiting).
func isGatedTry(op int16) bool { return op < opLinger && (op-1)%opPair < opUnlock-1 }

func unlockFn(shared bool, args string) string {
	if shared {
		return "pg_advisory_unlock_shared(" + args + ")"
	}
	return "pg_advisory_unlock(" + args + ")"
}

type req struct {
	op       int16
	key      int64
	res      int64
	err      error
	answered bool          // guarded by Mux.mu
	sig      chan struct{} // for a waiting caller: answered (buffered)
	h        *Held
	hook     func(r *req)
	after    *req // an undo's: the refused try it undoes, answered with it (complete, die)
}

// setup prepares the statements.
func (m *Mux) setup(ctx context.Context, pc *pgconn.PgConn) error {
	f := b2i(m.fenced)
	if _, err := pc.Prepare(ctx, muxStmt[f], muxSQL[f], nil); err != nil {
		return fmt.Errorf("prepare shared session: %w", TranslateErr(err))
	}
	for i, sql := range singleSQL[f] {
		if _, err := pc.Prepare(ctx, singleStmt[f][i], sql, nil); err != nil {
			return fmt.Errorf("prepare shared session: %w", TranslateErr(err))
		}
	}
	m.nc, m.fe = pc.Conn(), pc.Frontend()
	return nil
}

// takeLocked takes everything queued as the next round trip, marking the Mux busy; nil when nothing is queued.
func (m *Mux) takeLocked() []*req {
	if len(m.queue) == 0 {
		m.busy, m.idleSince = false, time.Now()
		return nil
	}
	batch := m.queue
	m.queue = nil
	m.busy, m.wire, m.sentAt = true, batch, time.Now()
	if cap(m.results) < len(batch) {
		m.results = make([]int64, len(batch))
	}
	m.results = m.results[:len(batch)]
	for i := range m.results {
		m.results[i] = -1
	}
	return batch
}

// wireBuf is what encoding a round trip needs, kept by the Mux from one round trip to the next (see send).
type wireBuf struct {
	buf    []byte
	params [2][]byte // a lone request's parameters
}

// send writes one round trip. It takes the Mux's wireBuf, which write puts back once the socket has the bytes (an
// atomic hand-over: the next round trip, which can only follow the answer to this one, reuses it), so that a lone
// caller's round trip allocates nothing to encode; a send that finds it not back yet makes another.
func (m *Mux) send(batch []*req) error {
	if h := testHookSettle.Load(); h != nil {
		(*h)(m, "send")
	}
	w := m.wb.Swap(nil)
	if w == nil {
		w = new(wireBuf)
	}
	if len(batch) == 1 {
		r := batch[0]
		w.params[0] = strconv.AppendInt(w.params[0][:0], r.key, 10)
		params := w.params[:1]
		if isGatedTry(r.op) {
			w.params[1] = strconv.AppendInt(w.params[1][:0], gateOf(r), 10)
			params = w.params[:2]
		}
		bind := pgproto3.Bind{PreparedStatement: singleStmt[b2i(m.fenced)][r.op-1], Parameters: params}
		buf, err := bind.Encode(w.buf[:0])
		return m.write(w, buf, err)
	}
	ops, keys := make([]byte, 1, 4*len(batch)+2), make([]byte, 1, 21*len(batch)+2)
	ops[0], keys[0] = '{', '{'
	var intents []byte // only for a batch with a try: the others' entries are 0 (unnest pads a short array)
	for i, r := range batch {
		if i > 0 {
			ops, keys = append(ops, ','), append(keys, ',')
		}
		ops = strconv.AppendInt(ops, int64(r.op), 10)
		keys = strconv.AppendInt(keys, r.key, 10)
		if isGatedTry(r.op) {
			if intents == nil {
				intents = append(make([]byte, 0, 21*len(batch)+2), '{')
				for range i {
					intents = append(intents, "0,"...)
				}
			} else {
				intents = append(intents, ',')
			}
			intents = strconv.AppendInt(intents, gateOf(r), 10)
		} else if intents != nil {
			intents = append(intents, ",0"...)
		}
	}
	ops, keys = append(ops, '}'), append(keys, '}')
	if intents == nil {
		intents = []byte("{}")
	} else {
		intents = append(intents, '}')
	}
	bind := pgproto3.Bind{PreparedStatement: muxStmt[b2i(m.fenced)], Parameters: [][]byte{ops, keys, intents}}
	buf, err := bind.Encode(w.buf[:0])
	return m.write(w, buf, err)
}

// gateOf is what a try's statement tests besides its key: for a shared try the key's intent, for an exclusive one
// the key's line's flag.
func gateOf(r *req) int64 {
	id := ID{Pair: r.op > opPair, V: r.key}
	if isSharedTry(r.op) {
		return id.Intent().V
	}
	return id.Waiting().V
}

// write sends a Bind (already in buf, w's buffer or a larger one) with its Execute and Sync, and gives w back.
func (m *Mux) write(w *wireBuf, buf []byte, err error) error {
	if err == nil {
		buf, err = (&pgproto3.Execute{}).Encode(buf)
	}
	if err == nil {
		buf, err = (&pgproto3.Sync{}).Encode(buf)
	}
	if err != nil {
		return err
	}
	_ = m.nc.SetReadDeadline(time.Now().Add(m.bound))
	_, err = m.nc.Write(buf)
	if cap(buf) <= 4096 { // a large batch's buffer is let go
		w.buf = buf[:0]
	}
	m.wb.Store(w)
	if err != nil {
		return fmt.Errorf("session ended: %w", err)
	}
	return nil
}
