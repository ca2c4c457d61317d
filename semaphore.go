package advlock

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"

	"github.com/advlock/advlock/internal/mutant"
)

// A Semaphore admits at most n holders at once, across every process that uses the same name and n: "at most n
// workers against a rate-limited API". Each holder holds one of n slots; slot i is the session lock on
// NameKey("advlock.semaphore/NAME/i"), so a slot is released like any lock (Unlock, the holder's session ending,
// its process dying) and no slot is ever lost. Do not use names with that prefix for other locks. advlock ls shows
// the slots as the int:N keys of those names; `advlock ls advlock.semaphore/NAME/0` finds slot 0.
type Semaphore struct {
	l       *Locker
	name    string
	keys    []Key
	waiting []atomic.Int32 // Acquire calls of this handle waiting for each slot
}

// spread picks the slot a waiting Acquire waits for: one that the fewest of this handle's waits wait for, at random
// among those (so that the waits of one process cover different slots, and those of many processes spread), and
// counts the wait on it.
func (s *Semaphore) spread() int {
	start := rand.IntN(len(s.keys))
	best := start
	for i := range s.keys {
		j := (start + i) % len(s.keys)
		if s.waiting[j].Load() < s.waiting[best].Load() {
			best = j
		}
	}
	s.waiting[best].Add(1)
	return best
}

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
	s.waiting = make([]atomic.Int32, len(s.keys))
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

// Acquire takes a slot, waiting until one is free or ctx ends (or [Wait]'s bound elapses: ErrNotAcquired). It tries
// every slot once (TryAcquire), then waits in the server for one slot, and each statement of that wait (one a wait
// slice, 0.9 s) first tries every other slot in the same round trip: the release of the slot waited for, or its
// holder's death, grants the wait at once; a slot freed elsewhere is taken within a slice. A waiting Acquire costs
// the server about what a waiting Lock does. It waits for a connection as Lock does: a try of the slots that finds
// the pool with no connection free (ErrPoolExhausted, which TryAcquire returns), or none to prove a new one with
// (ErrUnverified), counts as "no slot yet".
//
// Acquire never ends with ErrDeadlock: its wait is for any of n slots, and any slot that frees ends it, so it is
// not a wait for one holder. A cycle through a semaphore (its caller holds a lock that every slot's holder waits
// for) lasts until ctx or [Wait]'s bound ends; bound the wait when the caller holds locks. A slot held and passed
// to [Holding] counts like any held lock for the waits of its holder.
func (s *Semaphore) Acquire(ctx context.Context, opts ...CallOption) (*Lock, error) {
	co := callOptions(opts)
	lk, err := s.TryAcquire(ctx)
	if err == nil || !errors.Is(err, ErrNotAcquired) && !errors.Is(err, ErrPoolExhausted) && !errors.Is(err, ErrUnverified) {
		return lk, err
	}
	// A wait for one of n slots is not part of deadlock detection: any other slot may free while this one stays
	// held. It waits on a slot drawn at random (so that waiters spread over the slots), the others its
	// alternatives.
	slot := s.spread()
	var alts []Key
	for i := 1; i < len(s.keys); i++ {
		alts = append(alts, s.keys[(slot+i)%len(s.keys)])
	}
	wctx := context.WithValue(context.WithValue(ctx, noDetectKey{}, true), alternativesKey{}, alts)
	var wopts []CallOption
	if co.waitSet {
		wopts = append(wopts, Wait(co.wait))
	}
	lk, err = s.l.Lock(wctx, s.keys[slot], wopts...)
	s.waiting[slot].Add(-1)
	if errors.Is(err, ErrNotAcquired) && co.waitSet {
		return nil, &notAcquiredError{why: fmt.Sprintf("no slot of semaphore %q free within %v", s.name, co.wait)}
	}
	return lk, err
}

// alternativesKey carries, in a Lock's context, keys any of which will do instead of the one asked for (a
// semaphore's other slots): its wait in the server tries them in each statement (session.WithAlternatives).
type alternativesKey struct{}
