package lease

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/session"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/jackc/pgx/v5"
)

// BenchmarkStatements: a lease cycle's two statements alone (the grant of a try, then the release), sent as advlock
// sends them (literals over the simple protocol) on one plain pgx connection, with nothing of the Client around
// them: the least a cycle of these statements costs. Beside them, in the same run, raw pgx's advisory lock and
// unlock (docs/performance.md compares the three: these, raw pgx, and BenchmarkLeaseCycle of the root package):
//
//	go test -run '^$' -bench Statements -count 3 ./internal/lease
func BenchmarkStatements(b *testing.B) {
	c := pgtest.Conn(b, freshTables(b))
	ctx := context.Background()
	id := session.ID{V: time.Now().UnixNano()}
	owner := "0123456789abcdef0123456789abcdef/15000"
	b.Run("grant+release", func(b *testing.B) {
		for b.Loop() {
			var s string
			until := time.Now().Add(10 * time.Second).UnixMicro()
			if err := c.QueryRow(ctx, GrantSQL(id, owner, "bench", 15*time.Second, "", record{}, until),
				pgx.QueryExecModeSimpleProtocol).Scan(&s); err != nil || !strings.HasPrefix(s, "g ") {
				b.Fatal(s, err)
			}
			term, err := strconv.ParseInt(strings.Fields(s)[1], 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			if err := c.QueryRow(ctx, ReleaseSQL(id, owner, term), pgx.QueryExecModeSimpleProtocol).Scan(&s); err != nil || s != "1" {
				b.Fatal(s, err)
			}
		}
	})
	b.Run("raw advisory", func(b *testing.B) {
		var ok bool
		for b.Loop() {
			if err := c.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", id.V).Scan(&ok); err != nil || !ok {
				b.Fatal(ok, err)
			}
			if err := c.QueryRow(ctx, "SELECT pg_advisory_unlock($1)", id.V).Scan(&ok); err != nil || !ok {
				b.Fatal(ok, err)
			}
		}
	})
}
