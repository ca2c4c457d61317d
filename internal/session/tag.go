package session

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// WaitTag publishes one wait to other clients' deadlock detection. A wait whose context carries a tag
// ([WithWaitTag]) sends its statements with Comment in front (pg_stat_activity.query shows it while the wait runs),
// and records the pid of the session it waits on while it waits in the server.
type WaitTag struct {
	// Comment is what the wait's comment says of it, "w=LOCK h=REF,REF" (see Ref), chosen by this module (never
	// user input); the wait sends it in an SQL comment in front of each statement.
	Comment string
	pid     atomic.Uint32
	last    atomic.Uint32 // the pid it ran on last, once it left the server
	left    atomic.Int64  // when it left, on this process's monotonic clock (since tagEpoch)
}

// tagEpoch is what WaitTag's times count from: time.Since(tagEpoch) reads the monotonic clock.
var tagEpoch = time.Now()

// PID is the pid of the server session the wait runs on while it waits in the server; 0 before and after.
func (t *WaitTag) PID() uint32 { return t.pid.Load() }

// enter records that the wait waits in the server on session pid; leave, that it no longer does.
func (t *WaitTag) enter(pid uint32) { t.pid.Store(pid) }

func (t *WaitTag) leave() {
	// What Left reads first, and the pid last: a reading in between sees the wait still in the server.
	if p := t.pid.Load(); p != 0 {
		t.left.Store(int64(time.Since(tagEpoch)))
		t.last.Store(p)
		t.pid.Store(0)
	}
}

// Left returns the pid of the session the wait last waited on in the server and how long ago it left it, for a
// wait that is not in the server now; ok is false for one that is, or never was.
func (t *WaitTag) Left() (pid uint32, ago time.Duration, ok bool) {
	if t.pid.Load() != 0 {
		return 0, 0, false
	}
	pid = t.last.Load()
	if pid == 0 {
		return 0, 0, false
	}
	return pid, time.Since(tagEpoch) - time.Duration(t.left.Load()), true
}

type waitTagKey struct{}

// WithWaitTag returns ctx carrying t: a wait made with it publishes itself through t.
func WithWaitTag(ctx context.Context, t *WaitTag) context.Context {
	return context.WithValue(ctx, waitTagKey{}, t)
}

func waitTagFrom(ctx context.Context) *WaitTag {
	t, _ := ctx.Value(waitTagKey{}).(*WaitTag)
	return t
}

// Ref names one lock a session holds (or waits for): the server session's pid, the key and the mode.
type Ref struct {
	PID    uint32
	ID     ID
	Shared bool
}

// String renders r as "pid.objsubid.classid.objid.mode" (mode S or X), the columns pg_locks shows; ParseRef reads
// it back.
func (r Ref) String() string {
	return strconv.FormatUint(uint64(r.PID), 10) + "." + r.Lock()
}

// Lock renders r's key and mode as "objsubid.classid.objid.mode".
func (r Ref) Lock() string {
	sub, mode := 1, "X"
	if r.ID.Pair {
		sub = 2
	}
	if r.Shared {
		mode = "S"
	}
	return strconv.Itoa(sub) + "." + strconv.FormatUint(uint64(uint64(r.ID.V)>>32), 10) + "." +
		strconv.FormatUint(uint64(uint32(r.ID.V)), 10) + "." + mode
}

// ParseRef reads what Ref.String writes.
func ParseRef(s string) (Ref, bool) {
	pid, rest, ok := strings.Cut(s, ".")
	p, err := strconv.ParseUint(pid, 10, 32)
	if !ok || err != nil {
		return Ref{}, false
	}
	id, shared, ok := ParseLock(rest)
	return Ref{PID: uint32(p), ID: id, Shared: shared}, ok
}

// ParseLock reads what Ref.Lock writes.
func ParseLock(s string) (id ID, shared, ok bool) {
	f := strings.Split(s, ".")
	if len(f) != 4 || (f[0] != "1" && f[0] != "2") || (f[3] != "S" && f[3] != "X") {
		return ID{}, false, false
	}
	hi, err1 := strconv.ParseUint(f[1], 10, 32)
	lo, err2 := strconv.ParseUint(f[2], 10, 32)
	if err1 != nil || err2 != nil {
		return ID{}, false, false
	}
	return LockID(f[0] == "2", uint32(hi), uint32(lo)), f[3] == "S", true
}

// LockID is the key pg_locks shows as objsubid (2: a pair), classid and objid.
func LockID(pair bool, classid, objid uint32) ID {
	return ID{Pair: pair, V: int64(uint64(classid)<<32 | uint64(objid))}
}

type heldKey struct{}

type heldRefs struct {
	refs []Ref
	next *heldRefs
}

// WithHeld returns ctx saying that its caller holds refs besides what ctx already says (a lock held by another
// process on the caller's behalf, such as the advlock command that runs this one).
func WithHeld(ctx context.Context, refs ...Ref) context.Context {
	if len(refs) == 0 {
		return ctx
	}
	next, _ := ctx.Value(heldKey{}).(*heldRefs)
	return context.WithValue(ctx, heldKey{}, &heldRefs{refs: refs, next: next})
}

// HeldFrom returns what WithHeld put in ctx, innermost first.
func HeldFrom(ctx context.Context) []Ref {
	var out []Ref
	for h, _ := ctx.Value(heldKey{}).(*heldRefs); h != nil; h = h.next {
		out = append(out, h.refs...)
	}
	return out
}

type waitStartKey struct{}

// WithWaitStart returns ctx saying that the wait made with it began at start (the call that waits, before any
// in-process queue), which the wait publishes (see serverWait.comment).
func WithWaitStart(ctx context.Context, start time.Time) context.Context {
	return context.WithValue(ctx, waitStartKey{}, start)
}

// waitStart is what WithWaitStart put in ctx, else now.
func waitStart(ctx context.Context) time.Time {
	if t, ok := ctx.Value(waitStartKey{}).(time.Time); ok {
		return t
	}
	return time.Now()
}
