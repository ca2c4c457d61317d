package conformance

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/config"
)

// withWaitSlice shortens how long each statement of a wait in the server runs (1 s by default).
func withWaitSlice(d time.Duration) advlock.Option {
	return option(func(o *config.Options) { o.WaitSlice = d })
}

// requeueRace: a wait sent again every 2 ms (its slice shortened) while another Locker takes and frees the key as
// fast as it can, 300 times, so that grants land as a slice's lock_timeout fires and while the wait is between two
// slices: every Lock is granted (no queue entry is lost between slices), the key is then held once (free after one
// Unlock: a grant that raced a timeout was not taken a second time), and nothing is left held or waiting.
func (s *suite) requeueRace(t *testing.T) {
	h, other, obs := s.open(t, withWaitSlice(2*time.Millisecond)), s.open(t), s.observer(t)
	ctx := ctxT(t, 2*time.Minute)
	k := Key(t)
	for i := range 300 {
		stop, done := make(chan struct{}), make(chan struct{})
		go func() { // the other holder: takes the key whenever it is free, holds it 1 to 10 ms (several slices)
			defer close(done)
			for {
				select {
				case <-stop:
					return
				default:
				}
				lk, err := other.L.TryLock(ctx, k)
				if err != nil {
					time.Sleep(200 * time.Microsecond)
					continue
				}
				time.Sleep(time.Duration(1000+rand.IntN(9000)) * time.Microsecond)
				_ = lk.Unlock(ctx)
			}
		}()
		time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
		lctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		lk, err := h.L.Lock(lctx, k)
		cancel()
		close(stop)
		<-done
		if err != nil {
			t.Fatalf("iteration %d: a wait sent again every 2 ms was not granted: %v", i, err)
		}
		if err := lk.Unlock(ctx); err != nil {
			t.Fatalf("iteration %d: unlock: %v", i, err)
		}
		waitFree(t, obs, k) // held twice, the key would still be held by the waiter's pooled session
	}
	noIdleLocks(t, h, obs)
}
