package advlock_test

import (
	"context"
	"testing"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/conformance"
	"github.com/advlock/advlock/internal/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PgxBackend is the conformance backend for Lockers over pgxpool.
func pgxBackend(url, obsURL string) conformance.Backend {
	return conformance.Backend{
		Name: "pgxpool", URL: url, ObsURL: obsURL, EventDriven: true,
		Open: func(t *testing.T, url string, opts ...advlock.Option) conformance.Harness {
			pool := pgtest.Pool(t, url, nil)
			return conformance.Harness{
				L:     advlock.New(pool, opts...),
				InUse: func() int { return int(pool.Stat().AcquiredConns()) },
				Idle:  func(t *testing.T) []uint32 { return idlePIDs(t, pool) },
			}
		},
	}
}

func idlePIDs(t *testing.T, pool *pgxpool.Pool) []uint32 {
	t.Helper()
	ctx := context.Background()
	var pids []uint32
	for _, c := range pool.AcquireAllIdle(ctx) {
		var pid int32
		if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Error(err)
		}
		pids = append(pids, uint32(pid))
		c.Release()
	}
	return pids
}

func TestConformance(t *testing.T) {
	url := pgtest.URL(t)
	conformance.Run(t, pgxBackend(url, url))
}
