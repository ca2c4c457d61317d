package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/advlock/advlock"
)

const lsSynopsis = "[--json] [--dsn DSN] [KEY]"

func lsCmd(ctx context.Context, args []string, std Stdio) int {
	fs := newFlags("ls", lsSynopsis, std)
	asJSON := fs.Bool("json", false, "print a JSON array (stable field names) instead of a table")
	flagDSN := fs.String("dsn", "", "connection string (default $DATABASE_URL, then the PG* variables)")
	if code, done := parse(fs, args, std); done {
		return code
	}
	var filter *string // the KEY argument
	switch fs.NArg() {
	case 0:
	case 1:
		if _, err := parseKeyArg(fs.Arg(0)); err != nil {
			return usageError(std, "ls: %s", describe(err))
		}
		filter = new(string)
		*filter = fs.Arg(0)
	default:
		return usageError(std, "ls: at most one KEY\nUsage: advlock ls %s", lsSynopsis)
	}
	conn, code, bad := connString(std, "ls", *flagDSN)
	if bad {
		return code
	}
	rows, use, err := inspect(ctx, conn, filter)
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: ls: %s\n", describe(err))
		return exitUnavailable
	}
	if *asJSON {
		if rows == nil {
			rows = []advlock.LockInfo{}
		}
		enc := json.NewEncoder(std.Out)
		enc.SetIndent("", "  ")
		_ = enc.Encode(rows)
		return exitOK
	}
	printTable(std.Out, rows, time.Now())
	if use != nil {
		printLockTable(std.Out, *use)
	}
	return exitOK
}

// printLockTable writes the server's lock-table use in one line.
func printLockTable(w io.Writer, u advlock.LockTableUse) {
	pct := 0.0
	if u.Capacity > 0 {
		pct = 100 * float64(u.Used) / float64(u.Capacity)
	}
	fmt.Fprintf(w, "lock table: %d of about %d entries in use (%.1f%%), %d of them advisory locks in all databases\n",
		u.Used, u.Capacity, pct, u.Advisory)
}

// inspect connects once and lists the advisory locks, those of the key keyText names only when it is not nil.
// It also reads the lock table's use (nil if that read failed: the listing matters more).
func inspect(ctx context.Context, conn string, keyText *string) ([]advlock.LockInfo, *advlock.LockTableUse, error) {
	c, err := connect(ctx, conn, "advlock ls")
	if err != nil {
		return nil, nil, err
	}
	defer c.Close(context.WithoutCancel(ctx))
	var key *advlock.Key
	if keyText != nil {
		k, err := advlock.ResolveKey(ctx, c, *keyText)
		if err != nil {
			return nil, nil, err
		}
		key = &k
	}
	rows, err := advlock.Inspect(ctx, c)
	var db string
	if err == nil {
		_ = c.QueryRow(ctx, "SELECT current_database()").Scan(&db)
	}
	for i, r := range rows {
		// A key taken by advlock run NAME shows as NAME, which its session is named after; a key another tool
		// locks (golang-migrate's or Rails' migration lock of this database, a DistributedLock name) as that.
		if text, ok := strings.CutPrefix(r.ApplicationName, "advlock run "); ok {
			if k, err := advlock.ResolveKey(ctx, c, text); err == nil && k.Equal(r.Key) {
				rows[i].Key = k
				continue
			}
		}
		if scheme := advlock.KnownSchemes(r.Key, db); scheme != "" {
			if k, err := advlock.ParseKey(scheme); err == nil && k.Equal(r.Key) {
				rows[i].Key = k
			}
		}
	}
	var use *advlock.LockTableUse
	if u, uerr := advlock.LockTable(ctx, c); uerr == nil {
		use = &u
	}
	if err != nil || key == nil {
		return rows, use, err
	}
	var out []advlock.LockInfo
	for _, r := range rows {
		if r.Key.Equal(*key) {
			r.Key = *key // show the name the user gave
			out = append(out, r)
		}
	}
	return out, use, nil
}

// printTable writes rows as an aligned table for people; now dates the WAITING column.
func printTable(w io.Writer, rows []advlock.LockInfo, now time.Time) {
	if len(rows) == 0 {
		fmt.Fprintln(w, "no advisory locks held or awaited")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tMODE\tSTATUS\tWAITING\tBLOCKED BY\tPID\tAPPLICATION\tCLIENT\tBACKEND START\tSTATE")
	for _, r := range rows {
		status, waiting := "held", "-"
		if !r.Granted {
			status = "waiting"
			if r.WaitStart != nil {
				waiting = now.Sub(*r.WaitStart).Round(time.Millisecond).String()
			}
		}
		blocked := "-"
		if len(r.BlockedBy) > 0 {
			s := make([]string, len(r.BlockedBy))
			for i, p := range r.BlockedBy {
				s[i] = fmt.Sprint(p)
			}
			blocked = strings.Join(s, ",")
		}
		start := "-"
		if !r.BackendStart.IsZero() {
			start = r.BackendStart.Local().Format("2006-01-02 15:04:05")
		}
		app := r.ApplicationName
		if app == "" {
			app = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", r.Key, r.Mode(), status, waiting, blocked, r.PID,
			app, r.ClientAddr, start, r.State)
	}
	tw.Flush()
}
