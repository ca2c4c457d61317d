package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/mutant"
)

// TestMutants is the mutation suite: the library built with one deliberate bug at a time (the tag advlock_mutants;
// never in a normal build), each run as a short campaign, which must end with a violation of the class that bug
// breaks. A mutant the checker misses fails the test. The seed changes from run to run (it is logged): the checker
// must catch a mutant whatever the workers' choices.
func TestMutants(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the library with its mutants and starts private clusters (-short)")
	}
	bin := filepath.Join(t.TempDir(), "chaos.mutants")
	if out, err := exec.Command("go", "test", "-c", "-tags", "advlock_mutants", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building the workers with the mutants: %v\n%s", err, out)
	}
	seed := uint64(time.Now().UnixNano() % 1_000_000)
	cases := []struct {
		mutant string
		want   []string // any of these classes catches it
		d      time.Duration
	}{
		{"", nil, 10 * time.Second}, // the control: the same build with no mutant on finds nothing
		{mutant.GuardOff, []string{VOverlap}, 10 * time.Second},
		{mutant.LeadShared, []string{VOverlap}, 10 * time.Second},
		{mutant.SemaphoreExtraSlot, []string{VSemaphore}, 10 * time.Second},
		{mutant.UnlockSkippedShared, []string{VLeak}, 10 * time.Second},
	}
	for _, c := range cases {
		name := c.mutant
		if name == "" {
			name = "none"
		}
		t.Run(name, func(t *testing.T) {
			r, err := Run(context.Background(), Options{Duration: c.d, Seed: seed, Workers: 2, NoFaults: true,
				Mutant: c.mutant, Binary: bin})
			if err != nil {
				t.Fatal(err)
			}
			var b strings.Builder
			r.Print(&b)
			if c.want == nil {
				if !r.OK() {
					t.Log("\n" + b.String())
					t.Fatalf("seed %d: the build with the mutants, none on: %v", seed, r.ViolationsByKind)
				}
				return
			}
			caught := false
			for _, k := range c.want {
				caught = caught || r.ViolationsByKind[k] > 0
			}
			if !caught {
				t.Log("\n" + b.String())
				t.Fatalf("seed %d: the checker missed mutant %s (want a violation of %v; got %v)", seed, c.mutant, c.want, r.ViolationsByKind)
			}
			t.Logf("seed %d: mutant %s caught: %v", seed, c.mutant, r.ViolationsByKind)
			os.RemoveAll(r.Dir) // kept because something was found; here that was the point
		})
	}
}
