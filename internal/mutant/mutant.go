// Package mutant switches deliberate bugs on in the library, so that the chaos campaign's checker can be shown to
// catch each one (the mutation suite, chaos.TestMutants). The switches exist only in a build with the tag
// advlock_mutants; in every other build On is false for every name and the compiler drops the mutated code.
package mutant

// The mutants. Each names one bug of a class the checker claims to catch.
const (
	// GuardOff: the in-process gate admits every caller, so two holders in one process share one session's lock
	// through PostgreSQL's re-entrancy.
	GuardOff = "guard_off"
	// LeadShared: Lead campaigns for a shared lock, so every campaign leads at once.
	LeadShared = "lead_shared"
	// SemaphoreExtraSlot: a Semaphore of n slots uses n+1.
	SemaphoreExtraSlot = "semaphore_extra_slot"
	// UnlockSkippedShared: Unlock of a lock on a shared session reports success without unlocking; the shared
	// session keeps the key, which no other process can take while it lives.
	UnlockSkippedShared = "unlock_skipped_shared"
	// UnlockSkippedDedicated: Unlock of a lock on a session of its own reports success without unlocking and
	// returns the session to its pool still holding the key (the classic bug: pooled while held).
	UnlockSkippedDedicated = "unlock_skipped_dedicated"
	// SilentLossDedicated: the watcher of a session of its own finds the session ended and says nothing; only
	// Unlock finds out.
	SilentLossDedicated = "silent_loss_dedicated"
	// SilentLossShared: a shared session that ends tells none of its holders; only Unlock finds out.
	SilentLossShared = "silent_loss_shared"
	// CancelGrantDropped: a lock call whose ctx ended as the server granted the key reports the ctx's error (not
	// acquired) and leaves the key held: on a shared session, or on a session of its own returned to its pool.
	CancelGrantDropped = "cancel_grant_dropped"
	// DeadlockUndetected: deadlock detection finds cycles of waits and ends none of them.
	DeadlockUndetected = "deadlock_undetected"
	// DeadlockEveryMember: every Locker that sees a cycle ends its own waits in it, not only the one wait every
	// client ranks least, so two processes both give up.
	DeadlockEveryMember = "deadlock_every_member"
	// DeadlockFalse: a watched wait blocked by any holder, seen on two readings, is ended as if it closed a cycle.
	DeadlockFalse = "deadlock_false"
	// DeadlockStaleChoice: a wait that left the server a moment ago (its session given to another wait) counts at
	// once as one only its own Locker sees, and a wait in a cycle gives its session up to another wait of its Locker
	// as any other wait does: two clients whose readings saw the wait each way both give up.
	DeadlockStaleChoice = "deadlock_stale_choice"
	// DeadlockChoiceKept: a Locker keeps counting the readings that chose its wait after one chose another wait of
	// the cycle: readings that see the cycle differently by turns confirm a wait no other client chose.
	DeadlockChoiceKept = "deadlock_choice_kept"
	// DeadlockOtherCycle: a Locker counts the readings that chose its wait in one cycle and in the next, which formed
	// as a victim of the first let go (another caller took what it held): the wait ends on one reading of the new
	// cycle, while the first cycle's victim ends too.
	DeadlockOtherCycle = "deadlock_other_cycle"
	// DeadlockRecentChooses: a wait of a Locker that left the server a moment ago (its session given to another
	// wait), judged among the waits every client sees, may draw the choice to another wait of that Locker, which
	// ends while the other clients, whose readings no longer show it, end another wait of the same cycle.
	DeadlockRecentChooses = "deadlock_recent_chooses"
	// TokenNoTimeline: a fencing token is the sequence's value alone, without the server's timeline above it, so a
	// promoted standby whose sequence lagged hands out tokens lower than the lost primary's.
	TokenNoTimeline = "token_no_timeline"
	// IntentIgnored: readers ignore the intent of a writer waiting for their key (a shared try passes, a shared
	// wait granted between two of the writer's slices keeps the key), so readers that come and go starve it.
	IntentIgnored = "intent_ignored"
	// WaitRequeueBack: a wait does not stand in its key's line: each slice's end sends it to the back of the
	// server's queue, behind every wait that came after it.
	WaitRequeueBack = "wait_requeue_back"
	// LeaseRenewUnkeyed: a lease's renewal is keyed on its key alone, not on its owner and term, so a holder whose
	// lease was broken renews the lease that took its place, and acts on as its holder.
	LeaseRenewUnkeyed = "lease_renew_unkeyed"
	// LeaseTermReused: a lease's holder presents the first term its process was granted for the key as its
	// fencing token, whatever term this grant drew (a term that repeats, as a term counter that wraps would).
	LeaseTermReused = "lease_term_reused"
	// LeaseTrustFromReply: a lease's holder counts its trust window from the answer to a grant or renewal instead
	// of from its send, so a slow answer lets it trust past the expiry the server gave.
	LeaseTrustFromReply = "lease_trust_from_reply"
	// LeaseNoRestartQuiet: the lease table's grant skips the quiet period after a crash or a promotion, so a server
	// that lost the last grants and renewals its holders were told of (they commit without waiting for their WAL to
	// be flushed; a standby had not received them) grants those keys again at once.
	LeaseNoRestartQuiet = "lease_no_restart_quiet"
	// LeaseRestartTermKept: the first grant after a crash does not move the fencing sequence past the terms the
	// crash took back, so a later grant draws a term a holder before the crash was given.
	LeaseRestartTermKept = "lease_restart_term_kept"
	// LeaseLateGrantKept: a lease's grant is bounded by the statement bound alone (5 s), not by how long the lease
	// can be trusted, and an answer that comes after its trust window has closed is handed out as held, trusted as
	// if it had just been granted.
	LeaseLateGrantKept = "lease_late_grant_kept"
	// LeaseServerExpiry: a lease is taken over once its expiry has passed on the server's clock (as an earlier
	// version did), not once the taker has seen its record unchanged for a lease length on its own clock: a server
	// clock that steps forward expires every lease while its holder still trusts it.
	LeaseServerExpiry = "lease_server_expiry"
	// LeaseGrantNoDeadline: a lease's grant carries no latest moment at which it may still grant, so a grant held
	// back on its way (a stopped pooler that forwards it when it continues) reaches the server after its caller gave
	// up and grants a lease that nobody holds.
	LeaseGrantNoDeadline = "lease_grant_no_deadline"
	// LeaseUndoOnce: a lease grant whose outcome is unknown is undone by one delete, not tried again until it can
	// tell (as an earlier version did): a grant held back on its way (a stopped pooler) arrives after that delete and
	// grants a lease that nobody holds.
	LeaseUndoOnce = "lease_undo_once"
	// LeaseRenewNoDeadline: a lease's renewal carries no latest moment at which it may still renew, so a renewal
	// held back on its way (a stopped pooler) renews a lease its holder has stopped trusting.
	LeaseRenewNoDeadline = "lease_renew_no_deadline"
	// LeaseSweepServerExpiry: the sweep deletes a lease once its expiry has passed on the server's clock, not once
	// it has seen its record unchanged for the holder's lease length on its own clock: a server clock that steps
	// forward deletes every lease while its holder still trusts it, and frees its key.
	LeaseSweepServerExpiry = "lease_sweep_server_expiry"
)

// All lists every mutant.
var All = []string{GuardOff, LeadShared, SemaphoreExtraSlot, UnlockSkippedShared, UnlockSkippedDedicated,
	SilentLossDedicated, SilentLossShared, CancelGrantDropped, DeadlockUndetected, DeadlockEveryMember, DeadlockFalse,
	DeadlockStaleChoice, DeadlockChoiceKept, DeadlockOtherCycle, DeadlockRecentChooses, TokenNoTimeline, IntentIgnored, WaitRequeueBack, LeaseRenewUnkeyed,
	LeaseTermReused, LeaseTrustFromReply, LeaseLateGrantKept, LeaseServerExpiry, LeaseGrantNoDeadline,
	LeaseUndoOnce, LeaseRenewNoDeadline, LeaseSweepServerExpiry, LeaseNoRestartQuiet, LeaseRestartTermKept}

// Env names the environment variable that selects the mutant in a build with the tag.
const Env = "ADVLOCK_MUTANT"
