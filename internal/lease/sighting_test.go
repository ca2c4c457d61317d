package lease

import (
	"testing"
	"time"
	"unsafe"
)

// A Client keeps a sighting for every row of the other Clients its sweep reads (many pods of thousands of leases
// each: tens of thousands each): its last sighting is a duration after its first, not a time.Time of its own.
func TestSightingSize(t *testing.T) {
	if n := unsafe.Sizeof(sighting{}); n > 56 {
		t.Errorf("a sighting takes %d bytes, want at most 56", n)
	}
}

// A record seen once is not due, however long ago (a later read must see it unchanged too); seen again, it is due
// its holder's length after the first sighting, and its last sighting is the second.
func TestSightingDue(t *testing.T) {
	first := time.Now()
	s := sighting{rec: record{term: 1, exp: 2}, first: first, need: time.Second}
	if _, ok := due(s); ok {
		t.Error("a record seen once is due")
	}
	s.again = first.Add(300 * time.Millisecond).Sub(s.first)
	if at, ok := due(s); !ok || !at.Equal(first.Add(time.Second)) || at.Sub(first) != time.Second {
		t.Errorf("seen again: due %v, %v; want a second after the first sighting", at, ok)
	}
	if !s.last().Equal(first.Add(300*time.Millisecond)) || s.last().Sub(first) != 300*time.Millisecond {
		t.Errorf("last %v, want 300 ms after %v", s.last(), first)
	}
}
