package session

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
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

// A try's failure to connect within its bound is found by errors.As as a *pgconn.ConnectError, and matches no
// context error (the caller set no deadline).
func TestNoConnWithinIsConnectError(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	_, dialErr := pgconn.Connect(ctx, "postgres://u@10.255.255.1:9/db?connect_timeout=1")
	if dialErr == nil {
		t.Fatal("connected to a blackholed address")
	}
	err := error(&noConnWithin{dialErr})
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		t.Fatalf("errors.As(%v, *pgconn.ConnectError) = false", err)
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		t.Fatalf("%v matches a context error", err)
	}
	if !strings.HasPrefix(err.Error(), "acquire connection: none within") {
		t.Fatalf("message: %v", err)
	}
}
