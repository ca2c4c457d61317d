package lease

import (
	"errors"
	"testing"
)

// pager models the two tables' cursors as pageTables sees them: a table of n pages, its cursor at a page (0: its
// start), each read of it reading the page at the cursor and moving it on, back to 0 after the last page.
type pager struct {
	pages, at [2]int
	reads     [2][]int // the pages each table's reads read, in order
	calls     int
}

func (p *pager) read(leases, waits bool) (bool, bool, error) {
	p.calls++
	for i, asked := range []bool{leases, waits} {
		if asked {
			p.reads[i] = append(p.reads[i], p.at[i])
			p.at[i] = (p.at[i] + 1) % p.pages[i]
		}
	}
	return p.at[0] != 0, p.at[1] != 0, nil
}

// A sweep period reads each table from its cursor to its end, each page once, however the two tables' page counts
// differ (before, the reads went on until both cursors came back to the start after the same read: with 2 and 13
// pages, up to 25 reads a period, a short table read again and again and a long one left mid-table), at most
// sweepPages reads; a period cut short by that bound goes on where it stopped; between pages it beats its turn once
// due, and stops when the turn is lost.
func TestPageTables(t *testing.T) {
	never := func() bool { return false }
	keep := func() (bool, error) { t.Fatal("a beat that was not due"); return true, nil }
	for _, c := range []struct{ leases, waits int }{{1, 1}, {2, 13}, {13, 2}, {3, 3}, {25, 1}} {
		p := &pager{pages: [2]int{c.leases, c.waits}}
		for period := range 3 {
			p.reads = [2][]int{}
			if err := pageTables(p.read, never, keep); err != nil {
				t.Fatal(err)
			}
			for i, n := range p.pages {
				if len(p.reads[i]) != n || p.at[i] != 0 {
					t.Fatalf("%v pages, period %d: table %d read pages %v, cursor at %d; want each of its %d once, back at the start",
						p.pages, period, i, p.reads[i], p.at[i], n)
				}
				for j, pg := range p.reads[i] {
					if pg != j {
						t.Fatalf("%v pages: table %d read pages %v, want in order from 0", p.pages, i, p.reads[i])
					}
				}
			}
		}
	}

	// More pages than a period reads: 40 and 3. The first period stops after sweepPages reads; the next goes on from
	// there to the end, and does not read the short table again.
	p := &pager{pages: [2]int{40, 3}}
	if err := pageTables(p.read, never, keep); err != nil {
		t.Fatal(err)
	}
	if p.calls != sweepPages || p.at[0] != sweepPages || len(p.reads[1]) != 3 {
		t.Fatalf("40 and 3 pages, first period: %d reads, leases at page %d, waits read %v", p.calls, p.at[0], p.reads[1])
	}
	p.reads, p.calls = [2][]int{}, 0
	if err := pageTables(p.read, never, keep); err != nil {
		t.Fatal(err)
	}
	if p.calls != 40-sweepPages || p.at[0] != 0 || len(p.reads[1]) != 3 {
		t.Fatalf("40 and 3 pages, second period: %d reads, leases at page %d, waits read %v; want %d reads, the waits read once", p.calls, p.at[0], p.reads[1], 40-sweepPages)
	}

	// Beats between pages when due; a lost turn or a failed beat stops the period.
	p = &pager{pages: [2]int{10, 1}}
	beats := 0
	err := pageTables(p.read, func() bool { return true }, func() (bool, error) { beats++; return beats < 4, nil })
	if err != nil || beats != 4 || p.calls != 4 {
		t.Fatalf("a turn lost at the 4th beat: %d beats, %d reads (%v); want 4 and 4", beats, p.calls, err)
	}
	failed := errors.New("no answer")
	p = &pager{pages: [2]int{10, 1}}
	if err := pageTables(p.read, func() bool { return true }, func() (bool, error) { return true, failed }); !errors.Is(err, failed) || p.calls != 1 {
		t.Fatalf("a beat that failed: %v after %d reads; want its error after 1", err, p.calls)
	}
}
