package mutant

import (
	"os/exec"
	"strings"
	"testing"
)

// In a build without the tag no mutant can be switched on, whatever the environment says; the library's normal
// build (and so every user's) never carries one.
func TestOffWithoutTheTag(t *testing.T) {
	if Enabled {
		t.Skip("built with advlock_mutants")
	}
	t.Setenv(Env, GuardOff)
	if On(GuardOff) {
		t.Fatal("a mutant is on in a build without the tag")
	}
	// And the library's packages link no switch that reads the environment: only this file's On.
	out, err := exec.Command("go", "list", "-f", "{{.GoFiles}}", ".").Output()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "on.go") {
		t.Fatalf("the normal build compiles on.go: %s", out)
	}
}
