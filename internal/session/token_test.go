package session

import (
	"strconv"
	"strings"
	"testing"
)

// The literal numbers of tokenExpr are maxTimeline and TokenSeqBits, and a grant draws its token with it.
func TestTokenExpr(t *testing.T) {
	if want := ", " + strconv.Itoa(maxTimeline) + ") << " + strconv.Itoa(TokenSeqBits) + ") + "; !strings.Contains(tokenExpr, want) {
		t.Errorf("tokenExpr %q does not shift by TokenSeqBits with maxTimeline (%q)", tokenExpr, want)
	}
	if g := grant(true); !strings.HasPrefix(g, "("+tokenExpr+" + 0 * length(") {
		t.Errorf("the grant %q does not draw its token with tokenExpr", g)
	}
}
