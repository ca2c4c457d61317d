//go:build advlock_mutants

package mutant

import "os"

// Enabled reports whether this build can switch mutants on.
const Enabled = true

var selected = os.Getenv(Env)

// On reports whether the mutant name is the one selected by the environment variable Env.
func On(name string) bool { return selected == name }
