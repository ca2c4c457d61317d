package conformance

import (
	"errors"
	"testing"
	"time"

	"github.com/advlock/advlock"
)

// Close aborts Lock calls that wait, in the server or in-process, with ErrClosed, and leaves nothing held.
func (s *suite) closeAbortsWaiters(t *testing.T) {
	holder, obs := s.open(t), s.observer(t)
	ctx := ctxT(t, 20*time.Second)
	k := Key(t)
	hl, err := holder.L.TryLock(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	h := s.openURL(t, s.be.URL)
	errc := make(chan error, 2)
	go func() { _, err := h.L.Lock(ctx, k); errc <- err }() // waits in the server
	waitQueued(t, obs, k)
	go func() { _, err := h.L.Lock(ctx, k); errc <- err }() // waits in-process
	time.Sleep(50 * time.Millisecond)
	h.L.Close()
	for range 2 {
		select {
		case err := <-errc:
			if !errors.Is(err, advlock.ErrClosed) {
				t.Errorf("waiting Lock after Close: %v, want ErrClosed", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a waiting Lock did not return after Close")
		}
	}
	if err := hl.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
	waitFree(t, obs, k)
	noIdleLocks(t, h, obs)
}
