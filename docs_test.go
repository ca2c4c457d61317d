package advlock_test

import (
	"go/build"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// The documentation: the README and every page of docs/.
func docFiles(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("docs/*.md")
	if err != nil || len(pages) == 0 {
		t.Fatalf("no docs/*.md: %v", err)
	}
	return append([]string{"README.md"}, pages...)
}

// A fenced block of a Markdown file: its language, the line its fence opens on (1-based) and its lines.
type fenced struct {
	lang  string
	line  int
	lines []string
}

// fences returns the fenced code blocks of a Markdown text (fences may be indented, as in a list item).
func fences(text string) []fenced {
	var out []fenced
	var cur *fenced
	for i, line := range strings.Split(text, "\n") {
		s := strings.TrimSpace(line)
		switch {
		case cur == nil && strings.HasPrefix(s, "```"):
			cur = &fenced{lang: strings.TrimSpace(strings.TrimPrefix(s, "```")), line: i + 1}
		case cur != nil && s == "```":
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.lines = append(cur.lines, line)
		}
	}
	return out
}

// dedent trims trailing white space from each line and the indentation common to the lines that are not blank.
func dedent(lines []string) []string {
	out := make([]string, len(lines))
	prefix := ""
	first := true
	for i, l := range lines {
		out[i] = strings.TrimRight(l, " \t\r")
		if out[i] == "" {
			continue
		}
		ind := out[i][:len(out[i])-len(strings.TrimLeft(out[i], " \t"))]
		if first {
			prefix, first = ind, false
			continue
		}
		for !strings.HasPrefix(ind, prefix) {
			prefix = prefix[:len(prefix)-1]
		}
	}
	for i, l := range out {
		out[i] = strings.TrimPrefix(l, prefix)
	}
	return out
}

// buildingGoFiles returns the lines of every Go file of the repository (its modules included: contrib/*, bench)
// that a build for this platform with the default tags compiles, examples and tests among them.
func buildingGoFiles(t *testing.T) map[string][]string {
	t.Helper()
	files := map[string][]string{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != "." && (strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") {
			return nil
		}
		if ok, err := build.Default.MatchFile(filepath.Dir(path), name); err != nil || !ok {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		files[path] = strings.Split(string(b), "\n")
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// excerptOf reports whether block (dedented) is a run of whole lines of file, once both are dedented.
func excerptOf(block, file []string) bool {
	if len(block) == 0 {
		return false
	}
	head := strings.TrimLeft(block[0], " \t")
	for i := 0; i+len(block) <= len(file); i++ {
		if strings.TrimLeft(strings.TrimRight(file[i], " \t\r"), " \t") != head {
			continue
		}
		if slices.Equal(dedent(file[i:i+len(block)]), block) {
			return true
		}
	}
	return false
}

// Every ```go block of the docs is an excerpt of a Go file that builds, so that the docs' code compiles and says
// what the code says: blocks come from examples/*/main.go, the Example functions, or snippets_test.go (code the
// docs show, compiled and never run). A block that is none of these is named with its file and line.
func TestDocsGoBlocks(t *testing.T) {
	src := buildingGoFiles(t)
	names := make([]string, 0, len(src))
	for name := range src {
		names = append(names, name)
	}
	slices.Sort(names)
	blocks := 0
	for _, doc := range docFiles(t) {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range fences(string(b)) {
			if f.lang != "go" {
				continue
			}
			blocks++
			block := dedent(f.lines)
			found := slices.ContainsFunc(names, func(name string) bool { return excerptOf(block, src[name]) })
			if !found {
				t.Errorf("%s:%d: this ```go block is not an excerpt of any Go file that builds (make it one, e.g. in "+
					"snippets_test.go):\n%s", doc, f.line, strings.Join(block, "\n"))
			}
		}
	}
	if blocks == 0 {
		t.Fatal("no ```go block found in the docs")
	}
}

// TestDocsGoBlocksCatches shows that the excerpt check fails for code that is not in the repository, and for a
// block that matches only part of a line.
func TestDocsGoBlocksCatches(t *testing.T) {
	file := strings.Split("func f() {\n\tx := 1\n\tif x > 0 {\n\t\tprintln(x)\n\t}\n}", "\n")
	for _, tc := range []struct {
		block string
		want  bool
	}{
		{"x := 1\nif x > 0 {\n\tprintln(x)\n}", true},
		{"\t\tx := 1\n\t\tif x > 0 {\n\t\t\tprintln(x)\n\t\t}", true},
		{"x := 2", false},
		{"x := 1\nif x > 0 {\nprintln(x)\n}", false}, // indentation differs
		{"x :=", false},
	} {
		if got := excerptOf(dedent(strings.Split(tc.block, "\n")), file); got != tc.want {
			t.Errorf("excerptOf(%q) = %v, want %v", tc.block, got, tc.want)
		}
	}
}

// anchors returns the anchors GitHub makes for the headings of a Markdown text: lower case, punctuation dropped,
// spaces turned into hyphens, a repeated heading numbered (-1, -2, ...).
func anchors(text string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	inFence := false
	for _, line := range strings.Split(text, "\n") {
		s := strings.TrimSpace(line)
		if strings.HasPrefix(s, "```") {
			inFence = !inFence
			continue
		}
		if inFence || !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(h) {
			switch {
			case unicode.IsLetter(r) || unicode.IsNumber(r) || r == '-' || r == '_':
				b.WriteRune(r)
			case r == ' ':
				b.WriteByte('-')
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			seen[a]++
			a += "-" + string(rune('0'+n))
		} else {
			seen[a] = 1
		}
		out[a] = true
	}
	return out
}

// prose returns text with fenced blocks and code spans blanked out (line breaks kept), where links are not links.
func prose(text string) string {
	b := []byte(text)
	inFence := false
	start := 0
	for i := 0; i <= len(b); i++ {
		if i < len(b) && b[i] != '\n' {
			continue
		}
		line := string(b[start:i])
		if strings.HasPrefix(strings.TrimSpace(line), "```") || inFence {
			if strings.HasPrefix(strings.TrimSpace(line), "```") {
				inFence = !inFence
			}
			for j := start; j < i; j++ {
				b[j] = ' '
			}
		}
		start = i + 1
	}
	for i := 0; i < len(b); {
		if b[i] != '`' {
			i++
			continue
		}
		n := 0
		for i+n < len(b) && b[i+n] == '`' {
			n++
		}
		end := -1
		for j := i + n; j < len(b); j++ {
			if b[j] != '`' {
				continue
			}
			m := 0
			for j+m < len(b) && b[j+m] == '`' {
				m++
			}
			if m == n {
				end = j + m
				break
			}
			j += m - 1
		}
		if end < 0 {
			i += n
			continue
		}
		for j := i; j < end; j++ {
			if b[j] != '\n' {
				b[j] = ' '
			}
		}
		i = end
	}
	return string(b)
}

var mdLink = regexp.MustCompile(`\]\(([^()\s]+)\)`)

// Every relative link of the docs points to a file that exists and every #anchor to a heading of its page; every
// page of docs/ is linked from the README.
func TestDocsLinks(t *testing.T) {
	docs := docFiles(t)
	texts := map[string]string{}
	for _, doc := range docs {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		texts[filepath.Clean(doc)] = string(b)
	}
	anchorsOf := func(path string) map[string]bool {
		text, ok := texts[path]
		if !ok {
			b, err := os.ReadFile(path)
			if err != nil {
				return nil
			}
			text = string(b)
		}
		return anchors(text)
	}
	linked := map[string]bool{}
	for _, doc := range docs {
		text := prose(texts[filepath.Clean(doc)])
		for _, m := range mdLink.FindAllStringSubmatchIndex(text, -1) {
			target := text[m[2]:m[3]]
			line := 1 + strings.Count(text[:m[0]], "\n")
			if strings.HasPrefix(target, "http://") || strings.HasPrefix(target, "https://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			resolved := filepath.Clean(doc)
			if path != "" {
				resolved = filepath.Clean(filepath.Join(filepath.Dir(doc), path))
			}
			if _, err := os.Stat(resolved); err != nil {
				t.Errorf("%s:%d: link %q: %s does not exist", doc, line, target, resolved)
				continue
			}
			if doc == "README.md" {
				linked[resolved] = true
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(resolved, ".md") {
				t.Errorf("%s:%d: link %q: an anchor into a file that is not Markdown", doc, line, target)
				continue
			}
			if !anchorsOf(resolved)[anchor] {
				t.Errorf("%s:%d: link %q: %s has no heading whose anchor is #%s", doc, line, target, resolved, anchor)
			}
		}
	}
	for _, doc := range docs[1:] {
		if !linked[filepath.Clean(doc)] {
			t.Errorf("README.md does not link to %s", doc)
		}
	}
}

// The anchors are GitHub's.
func TestDocsAnchors(t *testing.T) {
	got := anchors("# advlock\n## `advlock run` and processes, next to `flock(1)`\n## database/sql\n## Do's errors\n" +
		"## PgBouncer 1.18 to 1.20\n## Options\n```sh\n# not a heading\n```\n## Options\n")
	for _, want := range []string{"advlock", "advlock-run-and-processes-next-to-flock1", "databasesql", "dos-errors",
		"pgbouncer-118-to-120", "options", "options-1"} {
		if !got[want] {
			t.Errorf("no anchor #%s in %v", want, got)
		}
	}
	if got["not-a-heading"] {
		t.Error("a comment in a code block made an anchor")
	}
}

// go doc shows what a user reads: PoolStats with its fields (not an alias of an internal type), and Option without
// the internal configuration type it applies to.
func TestGoDocShowsNoInternals(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command, to run go doc: %v", err)
	}
	for sym, want := range map[string][]string{
		"PoolStats": {"Max ", "Open ", "InUse ", "Idle ", "WaitCount "},
		"Option":    {"type Option interface"},
	} {
		out, err := exec.Command(gobin, "doc", ".", sym).CombinedOutput()
		if err != nil {
			t.Fatalf("go doc %s: %v\n%s", sym, err, out)
		}
		for _, w := range want {
			if !strings.Contains(string(out), w) {
				t.Errorf("go doc %s does not show %q:\n%s", sym, w, out)
			}
		}
		if strings.Contains(string(out), "config.") || strings.Contains(string(out), "session.PoolStats") {
			t.Errorf("go doc %s names an internal type:\n%s", sym, out)
		}
	}
}
