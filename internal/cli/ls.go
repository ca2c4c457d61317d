package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5"
)

const lsSynopsis = "[--json | --tree] [--watch [--interval DURATION]] [--dsn DSN] [KEY]"

func lsCmd(ctx context.Context, args []string, std Stdio) int {
	fs := newFlags("ls", lsSynopsis, fmt.Sprintf(`
After the locks, ls counts the server sessions of each client (client address and application name) that hold
or wait for them: a Locker from advlock.Open uses at most %d connections, shared sessions included.

Exit status: 0 (also when --watch ends with Ctrl-C); 69 database unreachable; 2 usage error.
`, advlock.DefaultOpenConns))
	asJSON := fs.Bool("json", false, "print a JSON array instead of a table (stable field names;\n"+
		"client_sessions counts the sessions of each row's client)")
	tree := fs.Bool("tree", false, "show who waits for whom: each key with its holders, then the sessions waiting for it,\n"+
		"indented, with how long they have waited")
	watch := fs.Bool("watch", false, "redraw every --interval until interrupted (in place on a terminal, like top;\n"+
		"one snapshot after another on a pipe or a dumb terminal)")
	interval := durationFlag(fs, "interval", time.Second, "with --watch, redraw every `DURATION`")
	flagDSN := fs.String("dsn", "", "connection string (default $DATABASE_URL, then the PG* variables)")
	if code, done := parse(fs, args, std); done {
		return code
	}
	if *asJSON && *tree {
		return usageError(std, "ls: --json and --tree exclude each other")
	}
	if *interval <= 0 {
		return badValue(fs, std, "interval", "must be positive")
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
		return usageError(std, "ls: at most one KEY; see advlock ls --help")
	}
	conn, code, bad := connString(std, "ls", *flagDSN)
	if bad {
		return code
	}
	l := &lister{conn: conn, withOthers: *tree && filter == nil}
	show := func(w io.Writer, rows []advlock.LockInfo, use *advlock.LockTableUse, now time.Time) {
		var others []otherWait
		var othersErr error
		if *tree {
			others, othersErr = l.others, l.othersErr
		}
		switch {
		case *asJSON:
			if rows == nil {
				rows = []advlock.LockInfo{}
			}
			enc := json.NewEncoder(w)
			enc.SetIndent("", "  ")
			_ = enc.Encode(rows)
			return
		case *tree:
			printTree(w, rows, now)
			printOtherWaits(w, others, rows)
			if othersErr != nil {
				fmt.Fprintf(w, "\nwaits for other locks: could not read them: %s\n", describe(othersErr))
			}
		default:
			printTable(w, rows, now)
		}
		printClients(w, rows)
		if use != nil {
			printLockTable(w, *use)
		}
	}
	defer l.close()
	if *watch {
		return watchLs(ctx, std, *interval, *asJSON, func() ([]advlock.LockInfo, *advlock.LockTableUse, error) {
			rows, use, _, err := l.inspect(ctx, filter)
			return rows, use, err
		}, show)
	}
	rows, use, _, err := l.inspect(ctx, filter)
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: ls: %s\n", describe(err))
		return exitUnavailable
	}
	show(std.Out, rows, use, time.Now())
	return exitOK
}

// watchLs redraws the listing every interval until ctx ends or SIGINT/SIGTERM comes (exit 0). On a terminal each
// frame replaces the last (cursor home, clear screen); elsewhere (a pipe, a file, TERM=dumb) frames follow one
// another with no escape codes. A failed read shows in the frame and the next one tries again.
func watchLs(ctx context.Context, std Stdio, interval time.Duration, asJSON bool,
	read func() ([]advlock.LockInfo, *advlock.LockTableUse, error), show func(io.Writer, []advlock.LockInfo, *advlock.LockTableUse, time.Time)) int {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	redraw := isTerminal(std.Out)
	for {
		rows, use, err := read()
		if ctx.Err() != nil {
			return exitOK
		}
		now := time.Now()
		var b bytes.Buffer
		if redraw {
			b.WriteString("\x1b[H\x1b[2J")
		}
		if !asJSON {
			fmt.Fprintf(&b, "advlock ls, every %v, at %s (Ctrl-C to stop)\n\n", interval, now.Format("15:04:05"))
		}
		if err != nil {
			fmt.Fprintf(&b, "advlock: ls: %s\n", describe(err))
		} else {
			show(&b, rows, use, now)
		}
		if !redraw && !asJSON {
			b.WriteString("\n")
		}
		_, _ = std.Out.Write(b.Bytes())
		select {
		case <-ctx.Done():
			return exitOK
		case <-time.After(interval):
		}
	}
}

// isTerminal reports whether w is a terminal that understands cursor movement: a character device, with TERM set
// and not "dumb".
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	if err != nil || fi.Mode()&os.ModeCharDevice == 0 || fi.Mode()&os.ModeDevice == 0 {
		return false
	}
	term := os.Getenv("TERM")
	return term != "" && term != "dumb"
}

// printTree writes, for each key, its holders and then the sessions waiting for it, longest waiting first, each
// with what it waits for when that is not simply the holders above it.
func printTree(w io.Writer, rows []advlock.LockInfo, now time.Time) {
	if len(rows) == 0 {
		fmt.Fprintln(w, "no advisory locks held or awaited")
		return
	}
	type group struct {
		key     string
		holders []advlock.LockInfo
		waiters []advlock.LockInfo
	}
	var order []string
	groups := map[string]*group{}
	for _, r := range rows {
		k := r.Key.String()
		g := groups[k]
		if g == nil {
			g = &group{key: k}
			groups[k] = g
			order = append(order, k)
		}
		if r.Granted {
			g.holders = append(g.holders, r)
		} else {
			g.waiters = append(g.waiters, r)
		}
	}
	who := func(r advlock.LockInfo) string {
		if r.Lease != nil && r.Granted {
			return fmt.Sprintf("lease of %s, %s%s", orDash(r.Lease.Holder), leaseState(r.Lease), pastWork(r))
		}
		if r.Lease != nil {
			return "lease wait of " + orDash(r.Lease.Holder)
		}
		s := fmt.Sprintf("pid %d %s", r.PID, r.Mode())
		if r.ApplicationName != "" {
			s += fmt.Sprintf(" %q", r.ApplicationName)
		}
		if r.ClientAddr != "" {
			s += " from " + r.ClientAddr
		}
		return s + pastWork(r)
	}
	cycles := 0
	for _, k := range order {
		g := groups[k]
		fmt.Fprintln(w, g.key)
		holders := map[int32]bool{}
		for _, h := range g.holders {
			holders[h.PID] = true
			fmt.Fprintf(w, "  held by %s\n", who(h))
		}
		if len(g.holders) == 0 {
			fmt.Fprintln(w, "  held by nobody this listing shows")
		}
		for _, h := range g.holders {
			if h.Lease != nil && len(g.holders) > 1 {
				fmt.Fprintln(w, "  (a lease and a session lock of one key do not exclude each other)")
				break
			}
		}
		sort.SliceStable(g.waiters, func(i, j int) bool {
			a, b := g.waiters[i].WaitStart, g.waiters[j].WaitStart
			return a != nil && (b == nil || a.Before(*b))
		})
		for i, r := range g.waiters {
			branch := "├─"
			if i == len(g.waiters)-1 {
				branch = "└─"
			}
			waited := "-"
			if r.WaitStart != nil {
				waited = now.Sub(*r.WaitStart).Round(100 * time.Millisecond).String()
			}
			var behind []string
			for _, p := range r.BlockedBy {
				if !holders[p] {
					behind = append(behind, strconv.Itoa(int(p)))
				}
			}
			extra := ""
			if len(behind) > 0 {
				extra = ", queued behind pid " + strings.Join(behind, ", ")
			}
			if len(r.CallerHolds) > 0 {
				var held []string
				for _, h := range r.CallerHolds {
					held = append(held, fmt.Sprintf("%s (pid %d)", h.Key, h.PID))
				}
				extra += "; its caller holds " + strings.Join(held, ", ")
			}
			if r.InCycle {
				extra += "  <- DEADLOCK: in a cycle of waits"
				cycles++
			}
			fmt.Fprintf(w, "    %s waiting %s: %s%s\n", branch, waited, who(r), extra)
		}
	}
	if cycles > 0 {
		fmt.Fprintf(w, "%d waits are in a cycle of waits: advlock ends one of the cycle's waits within about 2 s "+
			"(ErrDeadlock); a cycle that stays passes through a caller that does not detect deadlocks\n", cycles)
	}
}

// printClients writes, for each client of rows (client address and application name), how many server sessions
// of it the listing shows, how many of them hold locks and how many wait, and how many locks they hold; the
// clients with the most sessions first.
func printClients(w io.Writer, rows []advlock.LockInfo) {
	if len(rows) == 0 {
		return
	}
	type client struct{ addr, app string }
	type use struct {
		client
		sessions, holding, waiting map[int32]bool
		held                       int
	}
	byClient := map[client]*use{}
	var order []*use
	all := map[int32]bool{}
	leases, leaseWaits := 0, 0
	for _, r := range rows {
		if r.Lease != nil && r.Granted {
			leases++
			continue
		}
		if r.Lease != nil {
			leaseWaits++
			continue
		}
		c := client{r.ClientAddr, r.ApplicationName}
		u := byClient[c]
		if u == nil {
			u = &use{client: c, sessions: map[int32]bool{}, holding: map[int32]bool{}, waiting: map[int32]bool{}}
			byClient[c] = u
			order = append(order, u)
		}
		u.sessions[r.PID], all[r.PID] = true, true
		if r.Granted {
			u.holding[r.PID] = true
			u.held++
		} else {
			u.waiting[r.PID] = true
		}
	}
	if leases+leaseWaits > 0 {
		fmt.Fprintf(w, "\n%s held, %s for leases: rows of public.advlock_lease and advlock_lease_wait, on no "+
			"session; a lease excludes only other leases of its key\n", count(leases, "lease", "leases"), count(leaseWaits, "wait", "waits"))
	}
	if len(order) == 0 {
		return
	}
	sort.SliceStable(order, func(i, j int) bool {
		a, b := order[i], order[j]
		if len(a.sessions) != len(b.sessions) {
			return len(a.sessions) > len(b.sessions)
		}
		if a.addr != b.addr {
			return a.addr < b.addr
		}
		return a.app < b.app
	})
	fmt.Fprintf(w, "\n%d sessions hold or wait for these locks, from %d clients (client address and application name):\n",
		len(all), len(order))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SESSIONS\tHOLDING\tWAITING\tLOCKS HELD\tCLIENT\tAPPLICATION")
	for _, u := range order {
		app := u.app
		if app == "" {
			app = "-"
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%s\t%s\n", len(u.sessions), len(u.holding), len(u.waiting), u.held, u.addr, app)
	}
	tw.Flush()
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

// lister reads the advisory locks on one connection, kept across reads (ls --watch) and made again after a
// failure.
type lister struct {
	conn string // connection string
	c    *pgx.Conn
	db   string // current_database(), for naming other tools' keys

	withOthers bool        // also read the waits for other kinds of locks (--tree without KEY)
	others     []otherWait // what the last read found of them
	othersErr  error       // why it found nothing
}

func (l *lister) close() {
	if l.c != nil {
		l.c.Close(context.Background())
		l.c = nil
	}
}

// inspect lists the advisory locks, those of the key keyText names only when it is not nil (also returned,
// resolved), and reads the lock table's use (nil if that read failed: the listing matters more).
func (l *lister) inspect(ctx context.Context, keyText *string) ([]advlock.LockInfo, *advlock.LockTableUse, *advlock.Key, error) {
	if l.c == nil || l.c.IsClosed() {
		c, err := connect(ctx, l.conn, "advlock ls")
		if err != nil {
			return nil, nil, nil, err
		}
		if err := c.QueryRow(ctx, "SELECT current_database()").Scan(&l.db); err != nil {
			c.Close(context.WithoutCancel(ctx))
			return nil, nil, nil, err
		}
		l.c = c
	}
	rows, use, key, err := l.read(ctx, keyText)
	if err != nil {
		l.close() // the next read connects again
	}
	return rows, use, key, err
}

func (l *lister) read(ctx context.Context, keyText *string) ([]advlock.LockInfo, *advlock.LockTableUse, *advlock.Key, error) {
	var key *advlock.Key
	if keyText != nil {
		k, err := advlock.ResolveKey(ctx, l.c, *keyText)
		if err != nil {
			return nil, nil, nil, err
		}
		key = &k
	}
	rows, err := advlock.Inspect(ctx, l.c)
	if err != nil {
		return nil, nil, key, err
	}
	for i, r := range rows {
		// A key taken by advlock run NAME shows as NAME, which its session is named after; a key another tool
		// locks (golang-migrate's or Rails' migration lock of this database, a DistributedLock name) as that.
		named := r.ApplicationName
		if r.Lease != nil {
			_, named, _ = strings.Cut(r.Lease.Holder, " advlock run ") // host pid N advlock run KEY
			named = "advlock run " + named
		}
		if text, ok := strings.CutPrefix(named, "advlock run "); ok && text != "" {
			if k, err := advlock.ResolveKey(ctx, l.c, text); err == nil && k.Equal(r.Key) {
				rows[i].Key = k
				continue
			}
		}
		if k, ok := advlock.KnownKey(r.Key, l.db); ok {
			rows[i].Key = k
		}
	}
	l.nameLeaders(ctx, rows)
	var use *advlock.LockTableUse
	if u, uerr := advlock.LockTable(ctx, l.c); uerr == nil {
		use = &u
	}
	l.others, l.othersErr = nil, nil
	if l.withOthers { // like the lock table's use: a failed read is said, the listing still shown
		l.others, l.othersErr = readOtherWaits(ctx, l.c)
	}
	if key == nil {
		return rows, use, nil, nil
	}
	var out []advlock.LockInfo
	for _, r := range rows {
		if r.Key.Equal(*key) {
			r.Key = *key // show the name the user gave
			out = append(out, r)
		}
	}
	return out, use, key, nil
}

// nameLeaders shows the keys Lead campaigns for by their names, which Lead writes to the names table: each row
// whose key is still a number and a name there hashes to, if that name is printable. A missing table, or one this
// role may not read, names nothing.
func (l *lister) nameLeaders(ctx context.Context, rows []advlock.LockInfo) {
	var keys []int64
	for _, r := range rows {
		if v, ok := r.Key.Int64(); ok && r.Key.String() == advlock.Int64Key(v).String() { // a plain number
			keys = append(keys, v)
		}
	}
	if len(keys) == 0 {
		return
	}
	var exists bool
	if err := l.c.QueryRow(ctx, "SELECT to_regclass('"+session.NamesTable+"') IS NOT NULL").Scan(&exists); err != nil || !exists {
		return
	}
	res, err := l.c.Query(ctx, "SELECT key, name FROM "+session.NamesTable+" WHERE key = ANY($1)", keys)
	if err != nil {
		return
	}
	names := map[int64]advlock.Key{}
	for res.Next() {
		var v int64
		var name string
		// Only a name that hashes to its key, and only printable text: a row anyone may write must not put
		// control characters or escape sequences in an operator's terminal.
		if res.Scan(&v, &name) == nil && strings.IndexFunc(name, func(r rune) bool { return !unicode.IsPrint(r) }) < 0 {
			if k := advlock.NameKey(name); k.Equal(advlock.Int64Key(v)) {
				names[v] = k
			}
		}
	}
	res.Close()
	for i, r := range rows {
		if v, ok := r.Key.Int64(); ok && r.Key.String() == advlock.Int64Key(v).String() {
			if k, ok := names[v]; ok {
				rows[i].Key = k
			}
		}
	}
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
		if r.Lease != nil && r.Granted {
			fmt.Fprintf(tw, "%s\tlease\t%s\t-\t-\t-\t%s\t-\t-\t%s\n", r.Key, heldStatus(r), orDash(r.Lease.Holder), leaseState(r.Lease))
			continue
		}
		if r.Lease != nil {
			fmt.Fprintf(tw, "%s\tlease\twaiting\t%s\t-\t-\t%s\t-\t-\tpolling\n", r.Key,
				now.Sub(*r.WaitStart).Round(time.Millisecond), orDash(r.Lease.Holder))
			continue
		}
		status, waiting := heldStatus(r), "-"
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

// pastWork marks, for people, a lock held past its work (see advlock.HoldAtLeast).
func pastWork(r advlock.LockInfo) string {
	if !r.Lingering {
		return ""
	}
	return ", held past its work until its minimum hold has passed"
}

// heldStatus is the STATUS of a held lock in the table: held, or lingering (held past its work).
func heldStatus(r advlock.LockInfo) string {
	if r.Lingering {
		return "lingering"
	}
	return "held"
}

// leaseState says a lease's term and how long it has left (on the server's clock).
func leaseState(l *advlock.LeaseInfo) string {
	return fmt.Sprintf("term %d, %v left", l.Token, l.Left.Round(100*time.Millisecond))
}

// orDash is s for a table cell: "-" when empty, control characters (and what is not UTF-8) as '?', so that text
// anyone who may write the lease tables wrote cannot forge lines of the listing.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return strings.Map(func(r rune) rune {
		if r == utf8.RuneError || unicode.IsControl(r) {
			return '?'
		}
		return r
	}, s)
}

// otherWait is a session of the current database waiting for a lock that is not advisory (a row, a transaction
// id, a table), and the sessions that block it (pg_blocking_pids).
type otherWait struct {
	PID       int32
	App, Addr string
	What      string // e.g. "ShareLock on transactionid 745", "RowExclusiveLock on relation jobs"
	Waited    time.Duration
	BlockedBy []otherSession
}

type otherSession struct {
	PID       int32
	App, Addr string
}

// otherWaitsSQL reads the waits for locks other than advisory ones in the current database, with their blockers.
const otherWaitsSQL = `
SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), 'local'),
       l.mode || ' on ' || l.locktype || coalesce(' ' || l.relation::regclass::text, ' ' || l.transactionid::text, ''),
       extract(epoch FROM clock_timestamp() - coalesce(l.waitstart, a.query_start, clock_timestamp()))::float8,
       ARRAY(SELECT p FROM unnest(x.bp) AS p ORDER BY p),
       ARRAY(SELECT coalesce(s.application_name, '') FROM unnest(x.bp) AS p
             LEFT JOIN pg_stat_activity s ON s.pid = p ORDER BY p),
       ARRAY(SELECT coalesce(host(s.client_addr), 'local') FROM unnest(x.bp) AS p
             LEFT JOIN pg_stat_activity s ON s.pid = p ORDER BY p)
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
CROSS JOIN LATERAL (SELECT pg_blocking_pids(l.pid) AS bp) x
WHERE NOT l.granted AND l.locktype <> 'advisory' AND a.datname = current_database() AND a.pid <> pg_backend_pid()
ORDER BY 5 DESC, 1`

// readOtherWaits lists the waits for other kinds of locks (see otherWait), longest first.
func readOtherWaits(ctx context.Context, c *pgx.Conn) ([]otherWait, error) {
	rows, err := c.Query(ctx, otherWaitsSQL)
	if err != nil {
		return nil, err
	}
	var out []otherWait
	for rows.Next() {
		var w otherWait
		var secs float64
		var pids []int32
		var apps, addrs []string
		if err := rows.Scan(&w.PID, &w.App, &w.Addr, &w.What, &secs, &pids, &apps, &addrs); err != nil {
			rows.Close()
			return nil, err
		}
		w.Waited = time.Duration(secs * float64(time.Second))
		for i, p := range pids {
			if i < len(apps) && i < len(addrs) {
				w.BlockedBy = append(w.BlockedBy, otherSession{PID: p, App: apps[i], Addr: addrs[i]})
			}
		}
		out = append(out, w)
	}
	return out, rows.Err()
}

// printOtherWaits writes, after the tree, the waits for locks that are not advisory and who blocks them. advlock
// cannot tell which of its waits such a session's work belongs to (the holder's own transaction runs on another
// connection than its lock), so a cycle through them is not marked; what it shows is a hint: a session whose
// client (address and application name) also holds or waits for an advisory key says so.
func printOtherWaits(w io.Writer, others []otherWait, rows []advlock.LockInfo) {
	if len(others) == 0 {
		return
	}
	type client struct{ addr, app string }
	holds, waits := map[client][]string{}, map[client][]string{}
	for _, r := range rows {
		c := client{r.ClientAddr, r.ApplicationName}
		m := waits
		if r.Granted {
			m = holds
		}
		if k := r.Key.String(); !slices.Contains(m[c], k) {
			m[c] = append(m[c], k)
		}
	}
	hint := func(addr, app string) string {
		if app == "" { // nothing tells such clients apart
			return ""
		}
		c := client{addr, app}
		var parts []string
		if len(holds[c]) > 0 {
			parts = append(parts, "holds "+strings.Join(holds[c], ", "))
		}
		if len(waits[c]) > 0 {
			parts = append(parts, "waits for "+strings.Join(waits[c], ", "))
		}
		if len(parts) == 0 {
			return ""
		}
		return " [its client also " + strings.Join(parts, " and ") + "]"
	}
	name := func(pid int32, app, addr string) string {
		s := fmt.Sprintf("pid %d", pid)
		if app != "" {
			s += fmt.Sprintf(" %q", app)
		}
		return s + " from " + addr
	}
	fmt.Fprintln(w, "\nwaits for other locks (rows, transactions, tables), which advlock cannot attribute to its locks:")
	for _, o := range others {
		fmt.Fprintf(w, "  %s waiting %s: %s%s\n", name(o.PID, o.App, o.Addr), o.Waited.Round(100*time.Millisecond), o.What,
			hint(o.Addr, o.App))
		for _, b := range o.BlockedBy {
			fmt.Fprintf(w, "    blocked by %s%s\n", name(b.PID, b.App, b.Addr), hint(b.Addr, b.App))
		}
		if len(o.BlockedBy) == 0 {
			fmt.Fprintln(w, "    blocked by nobody now (granted since)")
		}
	}
}

// count says n things, one or many.
func count(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.Itoa(n) + " " + many
}
