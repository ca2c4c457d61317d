package advlock

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/advlock/advlock/internal/config"
	"github.com/advlock/advlock/internal/lease"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
)

// LeaseTableSQL creates the tables that [WithLeases] keeps its leases in (CREATE TABLE IF NOT EXISTS) and the
// functions that grant, renew and release them (CREATE OR REPLACE FUNCTION), for a team whose DDL goes through
// migrations; it may run again. A Locker creates them on first use where its role may.
const LeaseTableSQL = lease.DDL

// leaseConfig is what the Locker's options make of its leases.
func leaseConfig(o config.Options) lease.Config {
	c := lease.Defaults()
	if o.LeaseLength > 0 {
		c.Length = o.LeaseLength
		c.Renew, c.Margin, c.Sweep = c.Length/3, c.Length/15, c.Length/3
	}
	if o.LeasePoll > 0 {
		c.Poll = o.LeasePoll
	}
	host, _ := os.Hostname()
	c.Holder = host + " pid " + strconv.Itoa(os.Getpid())
	if o.AppName != "" && o.AppName != o.LeaseHolder {
		c.Holder += " " + o.AppName
	}
	if o.LeaseHolder != "" {
		c.Holder += " " + o.LeaseHolder
	}
	return c
}

// leaseCall refuses what leases cannot do: shared locks, and a wait without a bound whose caller holds locks
// (nothing would find the deadlock it may close).
func (l *Locker) leaseCall(ctx context.Context, shared, wait bool) error {
	if shared {
		return fmt.Errorf("shared locks are not leases (WithLeases): %w", errors.ErrUnsupported)
	}
	if _, bounded := ctx.Deadline(); wait && !bounded && len(heldRefs(ctx)) > 0 {
		return fmt.Errorf("a wait whose caller holds locks needs a bound (Wait, or a ctx deadline): leases have no "+
			"deadlock detection: %w", errors.ErrUnsupported)
	}
	return nil
}

// takeLease holds t as a lease: once (a try), or trying again until granted or ctx ends. A wait for any of several
// keys (a semaphore's) tries each in turn. Close ends a wait with ErrClosed.
func (l *Locker) takeLease(ctx context.Context, t session.Target, wait bool, onEnd session.OnEnd) (handle, error) {
	var alts []session.ID
	if keys, _ := ctx.Value(alternativesKey{}).([]Key); len(keys) > 0 {
		for _, k := range keys {
			alts = append(alts, k.id)
		}
	}
	if !wait {
		h, err := l.leases.Take(ctx, t.ID, onEnd)
		if err != nil {
			return nil, err
		}
		return h, nil
	}
	cctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(l.closeCtx, func() { cancel(ErrClosed) })
	defer stop()
	h, err := l.leases.Wait(cctx, t.ID, alts, onEnd)
	if err != nil {
		if ctx.Err() == nil && errors.Is(context.Cause(cctx), ErrClosed) {
			return nil, ErrClosed
		}
		return nil, err
	}
	return h, nil
}

// BreakLease deletes key's lease ([WithLeases]) if its term is token (a [LeaseInfo.Token] from [Inspect]),
// through conn: true when it did, false when that lease had already gone (released, or expired and taken over).
// Its holder learns at its next renewal (within a third of the lease length) and its lock ends with ErrLockLost;
// until then it may act as the holder while another takes the key: break a lease only when its holder is gone or
// stuck. The role needs DELETE on the lease table.
func BreakLease(ctx context.Context, conn Querier, key Key, token int64) (bool, error) {
	rows, err := conn.Query(ctx, lease.BreakSQL(key.id, token))
	if err != nil {
		return false, fmt.Errorf("advlock: break lease: %w", err)
	}
	n, err := pgx.CollectExactlyOneRow(rows, pgx.RowTo[int64])
	if err != nil {
		return false, fmt.Errorf("advlock: break lease: %w", err)
	}
	return n == 1, nil
}
