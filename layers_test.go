package advlock_test

import (
	"fmt"
	"go/build"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/advlock/advlock"

// layers says which packages of the module each package may import in its non-test files, as
// docs/architecture.md states it ("Which package may import which"). "" is the root package.
var layers = map[string][]string{
	"internal/mutant":              {},
	"internal/pgcluster":           {},
	"internal/testkit/faults":      {},
	"internal/session":             {"internal/mutant"},
	"internal/pgxwait":             {"internal/session"},
	"internal/config":              {"internal/session"},
	"internal/lease":               {"internal/session", "internal/mutant"},
	"":                             {"internal/session", "internal/config", "internal/pgxwait", "internal/mutant", "internal/lease"},
	"advsql":                       {"", "internal/session", "internal/config", "internal/pgxwait"},
	"internal/testkit/pgtest":      {"internal/pgcluster"},
	"internal/testkit/conformance": {"", "internal/config", "internal/testkit/faults", "internal/testkit/pgtest", "internal/session"},
	"internal/cli":                 {"", "internal/session", "internal/pgcluster"},
	"cmd/advlock":                  {"internal/cli"},
	"chaos":                        {"", "internal/testkit/faults", "internal/mutant", "internal/pgcluster", "internal/session", "internal/config", "internal/lease"},
	"advlocktest":                  {"", "internal/pgcluster", "internal/testkit/faults"},
	"examples/basic":               {""},
	"examples/http":                {""},
	"examples/slog":                {""},
	"examples/sql":                 {"", "advsql"},
}

// What internal/session may use of pgx: the wire protocol, not a pool or a driver.
var sessionPgx = []string{"github.com/jackc/pgx/v5/pgconn", "github.com/jackc/pgx/v5/pgproto3"}

// The test kit: what only tests and the chaos campaign use, and advlocktest, the public kit for users' tests. Every
// other package is the product (the library, its adapters, the command and what it links in, the examples), and no
// package of the product imports the test kit or package testing, whatever layers allows: a package that needs
// testing belongs under internal/testkit.
const testkit = "internal/testkit"

// product reports whether a package of the module (its path inside the module) is part of the product.
func product(rel string) bool {
	return rel != "chaos" && rel != "advlocktest" && rel != testkit && !strings.HasPrefix(rel, testkit+"/")
}

// importProblem says what is wrong with package rel's non-test files importing imp, or "" when nothing is: allowed
// is what its layer allows of the module.
func importProblem(rel string, allowed []string, imp string) string {
	switch {
	case imp == module || strings.HasPrefix(imp, module+"/"):
		dep := strings.TrimPrefix(strings.TrimPrefix(imp, module), "/")
		if product(rel) && !product(dep) {
			return fmt.Sprintf("%q imports %q: no package of the product imports the test kit (docs/architecture.md)", rel, dep)
		}
		if !slices.Contains(allowed, dep) {
			return fmt.Sprintf("%q imports %q, which its layer does not allow (docs/architecture.md)", rel, dep)
		}
	case imp == "testing" && product(rel):
		return fmt.Sprintf("%q imports testing: it belongs under %s, or the product must do without (docs/architecture.md)", rel, testkit)
	case rel == "internal/session" && strings.HasPrefix(imp, "github.com/jackc/") && !slices.Contains(sessionPgx, imp):
		return fmt.Sprintf("internal/session imports %s: of pgx it may use only %v", imp, sessionPgx)
	}
	return ""
}

// Every package of the module imports only what its layer allows (non-test files, this platform and the default
// tags, and the mutants' tag too): the state machine at the bottom knows no backend, the product no test kit.
func TestImportLayers(t *testing.T) {
	seen, reported := map[string]bool{}, map[string]bool{}
	report := func(format string, args ...any) {
		if msg := fmt.Sprintf(format, args...); !reported[msg] {
			reported[msg] = true
			t.Error(msg)
		}
	}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		name := d.Name()
		if path != "." && (strings.HasPrefix(name, ".") || name == "testdata") {
			return filepath.SkipDir
		}
		if path != "." {
			if _, err := os.Stat(filepath.Join(path, "go.mod")); err == nil {
				return filepath.SkipDir // a module of its own (contrib/*, bench)
			}
		}
		rel := filepath.ToSlash(path)
		if rel == "." {
			rel = ""
		}
		for _, tags := range [][]string{nil, {"advlock_mutants"}} {
			ctx := build.Default
			ctx.BuildTags = tags
			pkg, err := ctx.ImportDir(path, 0)
			if _, none := err.(*build.NoGoError); none {
				return nil
			}
			if err != nil {
				return err
			}
			seen[rel] = true
			allowed, ok := layers[rel]
			if !ok {
				report("package %q is in no layer: add it to layers (layers_test.go) and to docs/architecture.md", rel)
				return nil
			}
			for _, imp := range pkg.Imports {
				if msg := importProblem(rel, allowed, imp); msg != "" {
					report("%s", msg)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for rel := range layers {
		if !seen[rel] {
			t.Errorf("layers names %q, which is no package of the module", rel)
		}
	}
}

// The rules catch what they are for, the test kit's among them even where layers would allow the import.
func TestImportLayersCatches(t *testing.T) {
	for _, c := range []struct {
		rel, imp string
		bad      bool
	}{
		{"internal/cli", module + "/internal/testkit/pgtest", true},       // the product, though its layer allows it
		{"", module + "/internal/testkit/conformance", true},              // the library
		{"internal/pgcluster", module + "/internal/testkit/faults", true}, // linked into the command by the demo
		{"internal/pgcluster", "testing", true},
		{"examples/basic", "testing", true},
		{"", module + "/advsql", true}, // a layer's own rule
		{"internal/session", "github.com/jackc/pgx/v5/pgxpool", true},
		{"internal/cli", module + "/internal/pgcluster", false},
		{"internal/testkit/pgtest", "testing", false},
		{"internal/testkit/pgtest", module + "/internal/pgcluster", false}, // the test kit builds on the product
		{"chaos", module + "/internal/testkit/faults", false},
		{"internal/session", "github.com/jackc/pgx/v5/pgproto3", false},
	} {
		allowed := layers[c.rel]
		if c.rel == "internal/cli" {
			allowed = append(slices.Clip(allowed), "internal/testkit/pgtest") // as if someone had allowed it
		}
		if got := importProblem(c.rel, allowed, c.imp); (got != "") != c.bad {
			t.Errorf("%q importing %q: problem %q, want one: %v", c.rel, c.imp, got, c.bad)
		}
	}
}
