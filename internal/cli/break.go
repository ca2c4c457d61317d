package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/advlock/advlock"
	"github.com/jackc/pgx/v5/pgconn"
)

const breakSynopsis = "[--yes] [--dsn DSN] KEY"

func breakCmd(ctx context.Context, args []string, std Stdio) int {
	fs := newFlags("break", breakSynopsis, `
Shows the sessions holding KEY, asks for confirmation (unless --yes), and terminates them with
pg_terminate_backend. Any answer but y or yes, or none (end of input), terminates nobody and says so.

A lease of KEY (advlock run --leases, advlock.WithLeases) is broken by deleting its row: its holder learns at its
next renewal (within 5s by default) and ends its lock (advlock run ends COMMAND, exit 70); until then it may still
act as the holder while another takes KEY. Break a lease only when its holder is gone or stuck.

Exit status: 0 terminated or deleted (or nobody held KEY); 1 not confirmed; 77 no privilege to terminate a
holder or delete a lease; 69 database unreachable; 2 usage error.
`)
	yes := fs.Bool("yes", false, "do not ask for confirmation")
	flagDSN := fs.String("dsn", "", "connection string (default $DATABASE_URL, then the PG* variables)")
	if code, done := parse(fs, args, std); done {
		return code
	}
	if fs.NArg() != 1 {
		return usageError(std, "break: need exactly one KEY\nUsage: advlock break %s", breakSynopsis)
	}
	if _, err := parseKeyArg(fs.Arg(0)); err != nil {
		return usageError(std, "break: %s", describe(err))
	}
	conn, code, bad := connString(std, "break", *flagDSN)
	if bad {
		return code
	}
	keyText := fs.Arg(0)
	l := &lister{conn: conn}
	rows, _, k, err := l.inspect(ctx, &keyText)
	l.close()
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: break: %s\n", describe(err))
		return exitUnavailable
	}
	key := *k
	var holders []advlock.LockInfo
	for _, r := range rows {
		if r.Granted {
			holders = append(holders, r)
		}
	}
	if len(holders) == 0 {
		fmt.Fprintf(std.Out, "no session or lease holds %s\n", key)
		return exitOK
	}
	fmt.Fprintf(std.Out, "%s is held by:\n", key)
	printTable(std.Out, holders, time.Now())
	if !*yes {
		var what []string
		if n := len(holders) - leases(holders); n > 0 {
			what = append(what, countOf(n, "terminate %d backend", "terminate %d backends"))
		}
		if n := leases(holders); n > 0 {
			what = append(what, countOf(n, "delete %d lease", "delete %d leases"))
		}
		fmt.Fprintf(std.Out, "%s? [y/N] ", strings.Join(what, " and "))
		line, err := bufio.NewReader(std.In).ReadString('\n')
		if a := strings.ToLower(strings.TrimSpace(line)); a != "y" && a != "yes" {
			if err != nil || !echoes(std.In) { // no Enter echoed after the prompt: end its line first
				fmt.Fprintln(std.Out)
			}
			fmt.Fprintln(std.Out, "not confirmed; nothing terminated")
			return exitFailure
		}
	}
	c, err := connect(ctx, conn, "advlock break") // a fresh one: the prompt may have taken a while
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: break: %s\n", describe(err))
		return exitUnavailable
	}
	defer c.Close(context.WithoutCancel(ctx))
	for _, h := range holders {
		var ok bool
		var err error
		if h.Lease != nil {
			ok, err = advlock.BreakLease(ctx, c, key, h.Lease.Token)
		} else {
			err = c.QueryRow(ctx, "SELECT pg_terminate_backend($1)", h.PID).Scan(&ok)
		}
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && pgErr.Code == "42501" && h.Lease != nil:
			fmt.Fprintf(std.Err, "advlock: break: %s (needs DELETE on public.advlock_lease)\n", strings.TrimPrefix(err.Error(), "advlock: "))
			return exitNoPerm
		case errors.As(err, &pgErr) && pgErr.Code == "42501":
			fmt.Fprintf(std.Err, "advlock: break: %s\n", describe(err))
			return exitNoPerm
		case err != nil:
			fmt.Fprintf(std.Err, "advlock: break: %s\n", describe(err))
			return exitUnavailable
		case h.Lease != nil && !ok:
			fmt.Fprintf(std.Out, "the lease of term %d had already gone\n", h.Lease.Token)
		case h.Lease != nil:
			fmt.Fprintf(std.Out, "deleted the lease of term %d (%s); its holder learns at its next renewal\n",
				h.Lease.Token, orDash(h.Lease.Holder))
		case !ok:
			fmt.Fprintf(std.Out, "pid %d had already gone\n", h.PID)
		default:
			fmt.Fprintf(std.Out, "terminated pid %d (%s)\n", h.PID, h.ApplicationName)
		}
	}
	return exitOK
}

// leases counts the leases among rows.
func leases(rows []advlock.LockInfo) int {
	n := 0
	for _, r := range rows {
		if r.Lease != nil {
			n++
		}
	}
	return n
}

// echoes reports whether r is a terminal, which echoes the answer typed at a prompt and the Enter that ends it.
func echoes(r io.Reader) bool {
	f, ok := r.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
