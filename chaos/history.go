package main

import "time"

// What the checker reads: the histories of the workers, the ledger, the samples and the evidence of faults.

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
	ID      string
	Worker  int
	Op      string
	Key     string
	Mode    string
	Token   int64
	PID     uint32    // the server session that held it, as the library said (0: unknown)
	Wait    string    // the recorded wait that was granted it (a reader's or writer's), if any
	Begin   time.Time // just after the grant (its holder's record; zero in old histories: its first write)
	End     time.Time // just after the release returned; zero if its end was never recorded
	Release time.Time // when Unlock was called (or Do's fn returned): it ended between then and End; zero: not recorded
	Ended   bool      // its end was recorded (a SIGKILLed worker records none)
	Told    time.Time // when the library said the lock ended; zero if never
	ToldBy  string    // done: the lock's Done (fn's ctx) closed; unlock: only the release said so
	Session string    // where it was held: shared (a shared session's reader tells) or dedicated (its watcher)
	Cause   string
	Unlock  string
	Clean   bool // never told of an end, and the release was confirmed
	Writes  []Write
}

// Evidence is something that ended sessions, with the server's clock: a fault the campaign injected and saw take
// effect, or a line of the server's log saying a backend ended.
type Evidence struct {
	Kind  string    // a fault kind, or "session_end" (the server's log: a backend of the worker ended)
	At    time.Time // for a fault, when it was injected (its effect follows); for session_end, the end itself
	Until time.Time // a fault with a span (sigstop, blackhole, latency, slow_link): when it stopped
	// Stopped: a server restart's stop had returned, so that a crash (restart_immediate) had happened by then.
	Stopped time.Time
	Worker  int           // -1: every worker (a restart)
	PID     int32         // the backend it ended, when one
	Keys    []string      // the advisory locks that backend held just before (terminate)
	Term    int64         // the lease it deleted (break_lease)
	Delay   time.Duration // late_answers: how late each answer came (Until is the end of its span and this)
}

// ends reports whether e ends sessions (rather than only slowing or stopping a client).
func (e Evidence) ends() bool {
	switch e.Kind {
	case "sigstop", "blackhole", "partition", "latency", "slow_link", "break_lease", "slow_then_silent", "break_in_flight",
		"late_answers", "clock_step", "pgbouncer_stall", "pause_edge", "cut_edge":
		return false
	}
	return true
}

// Notice is one loss the server's evidence shows inside a critical section, and how its holder learned of it.
type Notice struct {
	Fault   string        // the evidence's kind
	By      string        // watcher, reader (a shared session's), unlock (only the release said so), none
	After   time.Duration // from the evidence to the notice (0 when the holder knew first)
	Verdict string        // ok, late_notice, never_told
}

// Holder is one row of a pg_locks sample.
type Holder struct {
	App     string
	PID     int32
	Granted bool
	Term    int64 `json:",omitempty"` // a lease's (lease campaigns)
}

// Sample is pg_locks at one moment (server clock), advisory rows only.
type Sample struct {
	At   time.Time
	Read time.Time           // pg_locks was read between At (the statement's start) and Read (zero: At)
	Held map[string][]Holder // Key.String() -> rows
}

// readBy is the latest moment the sample may show.
func (s Sample) readBy() time.Time {
	if s.Read.After(s.At) {
		return s.Read
	}
	return s.At
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
	Evidence []Evidence  // faults that took effect, and backend ends from the server's log
	Leaked   []Leftover  // advisory locks (or leases) left after the workers stopped
	Problems []Violation // worker panics, goroutine leaks, hangs, unexpected deaths
	Bound    time.Duration
	SemSlots map[string]int // the semaphore's slot keys, numbered, including slots n and above
	SemN     int
	AppName  func(worker int) string
	WorkerOf func(app string) (int, bool) // the inverse of AppName
	Shared   map[int]bool                 // workers whose Locker runs shared sessions (a loss is then learned by the reader)
	RunEnd   time.Time
	// The recorded waits: the pair operations' for their second key (a cycle of them must end within
	// DeadlockBound), and the readers' and writers' for the queue key (each granted within StarveBound of its key
	// being free to it in PostgreSQL's queue order).
	Waits         []*Wait
	DeadlockBound time.Duration
	StarveBound   time.Duration
	WaitSlice     time.Duration // how long each statement of a wait lasts in the server (0: the library's default)
	// A lease campaign: the lease table's log by term (nil otherwise), and the leases' length and renewal period.
	Leases      map[int64]*LeaseLife
	LeaseLog    []time.Time // when each entry of the lease table's log was written, in order (real clock)
	LeaseLength time.Duration
	LeaseRenew  time.Duration
	// When each worker's calls failed to connect, by worker: its path to the server was not open yet (a restarted
	// server's recovery, a pooler's server_login_retry), whatever the faults' own ends say.
	Unreachable map[int][]time.Time

	// Filled in by Check: how much it compared (a check that compared nothing proves nothing).
	Confirmed       int             // (sample, holder) pairs where pg_locks showed the believing holder
	ExcusedOverlaps int             // overlaps with a holder whose session the server's evidence shows ended first
	Notices         []Notice        // losses inside sections, judged against the bound
	Cycles          []*Cycle        // cycles of waits among the pair operations
	WaitsJudged     int             // readers' and writers' waits judged by their queue (no fault near them)
	OvertakeChances int             // crowd waits that a later one could have overtaken (see queue)
	FreeToGrant     []time.Duration // of those granted: from the moment their key was free to them to the grant
}

// Violation is one broken guarantee.
type Violation struct {
	Kind   string `json:"kind"`
	Detail string `json:"detail"`
}

// Violation kinds.
const (
	VOverlap    = "overlap"     // two holders of one key at once, without server evidence that the first had lost it
	VStaleToken = "stale_token" // the resource accepted a token not greater than one it accepted before
	VTokenOrder = "token_order" // a later grant's token not greater than an earlier one's; a clean holder refused
	VPhantom    = "phantom"     // a holder that believed it held while pg_locks showed it did not
	VSemaphore  = "semaphore"   // a holder of a slot n or above, or more than n holders at once
	VLeak       = "leak"        // an advisory lock held with no holder believing it, past the release bound
	VOrphan     = "orphan"      // a lease no holder was ever told of (its caller gave up on it) that stayed
	VRevived    = "revived"     // a lease renewed more than a lease length after its record before
	VLateNotice = "late_notice" // a holder told of a loss later than the bound after the server's evidence
	VNeverTold  = "never_told"  // a holder that stayed in its section past the bound, told of its loss only by Unlock
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

// begin is when c's holder started to believe it held: its record right after the grant, or its first write.
func (c *CS) begin() time.Time {
	if !c.Begin.IsZero() {
		return c.Begin
	}
	if len(c.Writes) > 0 {
		return c.Writes[0].At
	}
	return time.Time{}
}

// until is when c's holder stopped believing it held: its last write before it was told of an end.
func (c *CS) until() time.Time {
	bw := c.believing()
	if len(bw) == 0 {
		return c.begin()
	}
	return bw[len(bw)-1].At
}
