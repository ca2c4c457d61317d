package advlock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// A Lock call that is past begin when Close runs reaches its gate after Close woke the gates and released the
// holder: it must not take a slot in a gate made anew, which the woken waiter (finding the Locker closed) would then
// drop from the map under the new holder's feet (whose leaving would find no gate).
func TestGateEnterAfterClose(t *testing.T) {
	tg := session.Target{ID: session.ID{V: 42}}
	for i := 0; i < 2000; i++ {
		l := &Locker{gates: make(map[session.ID]*gate)}
		if _, err := l.enter(context.Background(), tg, true, false); err != nil {
			t.Fatal(err)
		}
		werr := make(chan error, 1)
		go func() { _, err := l.enter(context.Background(), tg, true, false); werr <- err }()
		for {
			l.mu.Lock()
			n := l.gates[tg.ID].queue.Len()
			l.mu.Unlock()
			if n == 1 {
				break
			}
			time.Sleep(10 * time.Microsecond)
		}
		// What Close does: closed, the gates woken, the holder released.
		l.mu.Lock()
		l.closed = true
		l.closeGates()
		l.leaveLocked(tg)
		l.mu.Unlock()
		_, err := l.enter(context.Background(), tg, true, false) // a call that was past begin
		if werr := <-werr; !errors.Is(werr, ErrClosed) {
			t.Fatalf("the woken waiter: %v, want ErrClosed", werr)
		}
		if err == nil {
			l.mu.Lock()
			g := l.gates[tg.ID]
			l.mu.Unlock()
			if g == nil {
				t.Fatalf("iteration %d: a slot taken after Close is in no gate (the woken waiter dropped it): leaving it would panic", i)
			}
			l.mu.Lock()
			l.leaveLocked(tg)
			l.mu.Unlock()
			continue
		}
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("enter after Close: %v, want ErrClosed", err)
		}
	}
}
