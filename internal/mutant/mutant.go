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
)

// Env names the environment variable that selects the mutant in a build with the tag.
const Env = "ADVLOCK_MUTANT"
