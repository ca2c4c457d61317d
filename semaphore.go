package advlock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/advlock/advlock/internal/mutant"
)

// A Semaphore admits at most n holders at once, across every process that uses the same name and n: "at most n
// workers against a rate-limited API". Each holder holds one of n slots; slot i is the session lock on
// NameKey("advlock.semaphore/NAME/i"), so a slot is released like any lock (Unlock, the holder's session ending,
// its process dying) and no slot is ever lost. Do not use names with that prefix for other locks. advlock ls shows
// the slots as the int:N keys of those names; `advlock ls advlock.semaphore/NAME/0` finds slot 0.
type Semaphore struct {
	l    *Locker
	name string
	keys []Key
}

// semaphorePoll is how often a waiting Acquire, which waits in the server on one slot, also tries the others once.
const semaphorePoll = 200 * time.Millisecond

// Semaphore returns the semaphore name of n slots (n >= 1; calls on one with n < 1 fail with ErrInvalidKey).
// Every process must use the same n for a name.
func (l *Locker) Semaphore(name string, n int) *Semaphore {
	s := &Semaphore{l: l, name: name}
	if mutant.On(mutant.SemaphoreExtraSlot) && n > 0 {
		n++
	}
	for i := range max(n, 0) {
		s.keys = append(s.keys, NameKey(fmt.Sprintf("advlock.semaphore/%s/%d", name, i)))
	}
	return s
}

// TryAcquire takes a free slot, or fails at once with ErrNotAcquired when all n are taken (ErrPoolExhausted when
// some could not be tried for want of a free connection: it never waits for one). The returned Lock works
// as any other: Unlock frees the slot; Done, Err and Token work as for a key.
func (s *Semaphore) TryAcquire(ctx context.Context) (*Lock, error) {
	if len(s.keys) == 0 {
		return nil, fmt.Errorf("advlock: semaphore %q: %w: n must be at least 1", s.name, ErrInvalidKey)
	}
	start := rand.IntN(len(s.keys)) // spread holders over the slots
	var exhausted error
	for i := range s.keys {
		lk, err := s.l.TryLock(ctx, s.keys[(start+i)%len(s.keys)])
		switch {
		case err == nil:
			return lk, nil
		case errors.Is(err, ErrPoolExhausted):
			exhausted = err // another slot may still be tried on a shared session already open
		case !errors.Is(err, ErrNotAcquired):
			return nil, err
		}
	}
	if exhausted != nil {
		return nil, exhausted // some slots could not be tried: "all taken" would not be true
	}
	return nil, &notAcquiredError{why: fmt.Sprintf("all %d slots of semaphore %q are taken", len(s.keys), s.name)}
}

// Acquire takes a slot, waiting until one is free or ctx ends (or [Wait]'s bound elapses: ErrNotAcquired). The
// wait is in the server, on one slot at a time: the release of that slot, or its holder's death, wakes the waiter
// at once; every 200 ms the waiter also tries every slot once, then waits on the next one, so a slot freed
// elsewhere is found within that bound. It waits for a connection too: a try of the slots that finds the pool with
// no connection free (ErrPoolExhausted, which TryAcquire returns), or none to prove a new one with (ErrUnverified),
// counts as "no slot yet", and the wait on a slot waits for a connection as Lock does.
//
// Acquire never ends with ErrDeadlock: its wait moves from slot to slot, and any slot that frees ends it, so it is
// not a wait for one holder. A cycle through a semaphore (its caller holds a lock that every slot's holder waits
// for) lasts until ctx or [Wait]'s bound ends; bound the wait when the caller holds locks. A slot held and passed
// to [Holding] counts like any held lock for the waits of its holder.
func (s *Semaphore) Acquire(ctx context.Context, opts ...CallOption) (*Lock, error) {
	co := callOptions(opts)
	var deadline time.Time
	if co.waitSet {
		deadline = time.Now().Add(co.wait)
	}
	slot := rand.IntN(max(len(s.keys), 1))
	for {
		lk, err := s.TryAcquire(ctx)
		if err == nil || !errors.Is(err, ErrNotAcquired) && !errors.Is(err, ErrPoolExhausted) && !errors.Is(err, ErrUnverified) {
			return lk, err
		}
		wait := semaphorePoll
		if co.waitSet {
			left := time.Until(deadline)
			if left <= 0 {
				return nil, &notAcquiredError{why: fmt.Sprintf("no slot of semaphore %q free within %v", s.name, co.wait)}
			}
			wait = min(wait, left)
		}
		slot = (slot + 1) % len(s.keys)
		// A wait on one of n slots is not part of deadlock detection: the slot waited on changes every
		// semaphorePoll, and another slot may free while this one stays held.
		lk, err = s.l.Lock(context.WithValue(ctx, noDetectKey{}, true), s.keys[slot], Wait(wait))
		if err == nil || !errors.Is(err, ErrNotAcquired) {
			return lk, err
		}
	}
}
