package session

import (
	"sync"
	"sync/atomic"
)

// End is how a held lock or lease ends, once: Done, Err and AfterEnd for those who watch it, Finish for its owner.
// Its zero value is a lock that has not ended. It makes nothing until asked: Done makes its channel on the first
// call (most locks are never watched), AfterEnd keeps its functions in a slice; a context of its own per lock cost
// two allocations more (about 100 bytes).
type End struct {
	once  sync.Once
	mu    sync.Mutex
	done  chan struct{} // made by the first Done call, closed at the end; guarded by mu
	ended atomic.Bool   // set under mu as it ends: err is then final
	err   error         // set before ended
	after []func()      // what AfterEnd arranged (nil where stopped); guarded by mu
}

// Done is closed when it has ended.
func (e *End) Done() <-chan struct{} {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.done == nil {
		if e.ended.Load() {
			return closedChan
		}
		e.done = make(chan struct{})
	}
	return e.done
}

// closedChan is Done's answer for an End that ended before anyone asked.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// Err is nil until it has ended; then why.
func (e *End) Err() error {
	if e.ended.Load() {
		return e.err
	}
	return nil
}

// AfterEnd arranges for f to run once it has ended (at once, in a goroutine of its own, if it has); stop cancels
// that, and reports whether it did. f runs inside Finish: it must not block, nor release or end what it watches
// (a cancel of a context is what it is for).
func (e *End) AfterEnd(f func()) (stop func() bool) {
	e.mu.Lock()
	if e.ended.Load() {
		e.mu.Unlock()
		go f()
		return func() bool { return false }
	}
	e.after = append(e.after, f)
	i := len(e.after) - 1
	e.mu.Unlock()
	return func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		if i < len(e.after) && e.after[i] != nil {
			e.after[i] = nil
			return true
		}
		return false
	}
}

// Finish ends it with err, once (a second call waits for the first to return): first the owner is told (tell, when
// not nil, which may return what to run last), then Done closes and Err says err, then what AfterEnd arranged runs,
// then what tell returned.
func (e *End) Finish(err error, tell func(error) func()) {
	e.once.Do(func() {
		e.err = err
		var then func()
		if tell != nil {
			then = tell(err)
		}
		e.mu.Lock()
		e.ended.Store(true)
		if e.done != nil {
			close(e.done)
		}
		after := e.after
		e.after = nil
		e.mu.Unlock()
		for _, f := range after {
			if f != nil {
				f()
			}
		}
		if then != nil {
			then()
		}
	})
}
