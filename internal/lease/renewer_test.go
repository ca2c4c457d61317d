package lease

import (
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
)

// state returns what the renewers hold for the loop: whether it runs, the leases waiting for it, when its later start
// is set (zero: none) and when it looks at them next (zero: it may not).
func (r *renewers) state() (running bool, adds []*Lease, laterAt, wakeAt time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.running, append([]*Lease(nil), r.adds...), r.laterAt, r.wakeAt
}

// quiet is a Config whose leases come to no renewal, nor to the end of their trust, within a test: these tests have
// no server (a nil pool), and the loop must send nothing.
func quiet() Config {
	c := Defaults()
	c.Length, c.Renew, c.Margin, c.Sweep = time.Hour, 20*time.Minute, time.Minute, 0
	return c
}

func (l *Lease) renewalsDone() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ended
}

// A lease released within its first renewal period costs the renewal loop nothing: the loop does not start (its start
// is set for the first renewal due), and each halt ends its lease's renewals at once, whatever its place among the
// leases waiting; the last one's halt unsets the start. (Before, every lease started the loop, and every halt waited
// for the loop to end its renewals.)
func TestShortLeasesLeaveTheLoopAlone(t *testing.T) {
	c := NewClient(nil, quiet())
	defer c.Close()
	ls := make([]*Lease, 4)
	for i := range ls {
		ls[i] = c.newLease(session.ID{V: int64(i)}, "o", 1, time.Now(), nil)
		ls[i].start()
	}
	running, adds, laterAt, _ := c.r.state()
	if running || len(adds) != len(ls) || !laterAt.Equal(ls[0].rs.next) {
		t.Fatalf("4 leases just granted: loop running %v, %d waiting, its start at %v; want not running, 4, %v",
			running, len(adds), laterAt, ls[0].rs.next)
	}
	for _, i := range []int{1, 0, 3, 2} { // the middle, the first, the last, the one left
		halted := make(chan struct{})
		go func() { ls[i].halt(); close(halted) }()
		select {
		case <-halted:
		case <-time.After(10 * time.Second):
			t.Fatalf("lease %d: its halt waits for a loop that does not run", i)
		}
		if !ls[i].renewalsDone() {
			t.Fatalf("lease %d halted: its renewals not ended", i)
		}
		running, adds, _, _ := c.r.state()
		if running {
			t.Fatalf("lease %d halted: the loop started", i)
		}
		for j, l := range adds {
			if l == ls[i] || l.addAt != j {
				t.Fatalf("lease %d halted: waiting %v, lease at %d says %d", i, adds, j, l.addAt)
			}
		}
	}
	if _, adds, laterAt, _ := c.r.state(); len(adds) != 0 || !laterAt.IsZero() {
		t.Errorf("every lease halted: %d waiting, the loop's start at %v; want none and unset", len(adds), laterAt)
	}
}

// A lease halted before it was handed to the renewals (a halt that found it nowhere) has its renewals ended as it
// is handed over: it neither waits for the loop nor sets its start. One whose halt was queued to the running loop as
// it was handed over is ended by both, once (300 tries of that race, and its two ends in the order that hurt).
func TestHaltBeforeStart(t *testing.T) {
	c := NewClient(nil, quiet())
	defer c.Close()
	l := c.newLease(session.ID{V: 1}, "o", 1, time.Now(), nil)
	l.stopping.Store(true) // as a halt does first
	l.start()
	if !l.renewalsDone() {
		t.Error("a lease halted before its start: its renewals not ended by the start")
	}
	if running, adds, laterAt, _ := c.r.state(); running || len(adds) != 0 || !laterAt.IsZero() {
		t.Errorf("loop running %v, %d waiting, start at %v; want nothing", running, len(adds), laterAt)
	}
	l.halt() // and a halt after it returns at once

	held := c.newLease(session.ID{V: 2}, "o", 1, time.Now(), nil)
	held.start()
	c.r.stopped() // the loop runs (as for a Close) with held
	for i := range 300 {
		raced := c.newLease(session.ID{V: int64(10 + i)}, "o", 1, time.Now(), nil)
		raced.started.Store(true) // as start does first, then its first renewal's moment
		raced.rs.next = time.Now().Add(c.cfg.Renew - raced.rtt)
		halted := make(chan struct{})
		go func() { raced.halt(); close(halted) }() // queued to the running loop, and waiting for it, or not yet
		c.r.add(raced)                              // the rest of start; before, both ended its renewals (a close of a closed channel)
		<-halted
		if !raced.renewalsDone() {
			t.Fatalf("a lease halted as it started: its renewals not ended")
		}
	}
	held.halt()
	<-c.r.stopped()

	// The two ends of such a race, in the order that hurt: a halt waiting (its channel made), ended by the start,
	// then by the loop the halt had told.
	l = c.newLease(session.ID{V: 4}, "o", 1, time.Now(), nil)
	l.stopped = make(chan struct{})
	l.renewalsEnded()
	l.renewalsEnded() // a close of a closed channel, before
	if !l.renewalsDone() {
		t.Error("renewals said ended twice: not ended")
	}
}

// A lease whose first renewal is due before the running loop next looks at the leases waiting wakes it: the loop
// takes it and looks again by its renewal. One due later does not wake it.
func TestEarlierRenewalWakesTheLoop(t *testing.T) {
	c := NewClient(nil, quiet())
	defer c.Close()
	a := c.newLease(session.ID{V: 1}, "o", 1, time.Now(), nil)
	a.start()
	c.r.stopped() // the loop starts now, as for a Close: a running loop that looks at a's renewal next
	wakeAt := func(want time.Time, what string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			_, adds, _, at := c.r.state()
			if at.Equal(want) && len(adds) == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the loop looks next at %v with %d waiting; want %v and none", what, at, len(adds), want)
			}
		}
	}
	wakeAt(a.rs.next, "a taken")
	later := c.newLease(session.ID{V: 2}, "o", 1, time.Now(), nil) // due after a's
	later.start()
	time.Sleep(50 * time.Millisecond)
	if _, adds, _, at := c.r.state(); len(adds) != 1 || !at.Equal(a.rs.next) {
		t.Errorf("a lease due after a's woke the loop: %d waiting, it looks next at %v", len(adds), at)
	}
	b := c.newLease(session.ID{V: 3}, "o", 1, time.Now().Add(-time.Minute), nil) // its grant's round trip a minute: due before a's
	b.start()
	if !b.rs.next.Before(a.rs.next) {
		t.Fatal("b is not due before a")
	}
	wakeAt(b.rs.next, "b taken")
	for _, l := range []*Lease{a, later, b} {
		l.halt()
	}
	select {
	case <-c.r.stopped():
	case <-time.After(5 * time.Second):
		t.Fatal("every lease halted: the loop still runs")
	}
}
