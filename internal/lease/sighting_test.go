package lease

import (
	"testing"
	"time"
	"unsafe"
)

// A Client keeps a sighting for every row of the other Clients its sweep reads (many pods of thousands of leases
// each: tens of thousands each): its times are monoTimes, 8 bytes each, not time.Times of 24.
func TestSightingSize(t *testing.T) {
	if n := unsafe.Sizeof(sighting{}); n > 40 {
		t.Errorf("a sighting takes %d bytes, want at most 40", n)
	}
}

// A monoTime is a moment on the monotonic clock: back as a time.Time, it is the moment it was made from, and the
// time between two of them is what the monotonic clock measured.
func TestMonoTime(t *testing.T) {
	a := time.Now()
	time.Sleep(2 * time.Millisecond)
	b := time.Now()
	if got := mono(b) - mono(a); time.Duration(got) != b.Sub(a) {
		t.Errorf("mono(b) - mono(a) = %v, want %v", time.Duration(got), b.Sub(a))
	}
	if !mono(a).at().Equal(a) || mono(b).at().Sub(a) != b.Sub(a) {
		t.Errorf("at() of %v: %v; of %v: %v", a, mono(a).at(), b, mono(b).at())
	}
	if far := a.Add(100 * 365 * 24 * time.Hour); mono(far).at().Sub(a) != far.Sub(a) {
		t.Errorf("a century on: %v, want %v", mono(far).at().Sub(a), far.Sub(a))
	}
}
