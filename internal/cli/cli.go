// Package cli is the advlock command. Main takes the arguments and standard streams and returns the exit status,
// so that tests call it directly.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"github.com/jackc/pgx/v5"
	"io"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/session"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Exit statuses (sysexits.h where one fits).
const (
	exitOK          = 0
	exitFailure     = 1  // break not confirmed, other failures
	exitUsage       = 2  // bad flags, bad KEY
	exitUnavailable = 69 // database unreachable or refused the connection
	exitLost        = 70 // the lock was lost while COMMAND ran
	exitDeadlock    = 71 // the wait for KEY closed a cycle of waits (nested advlock run in opposite orders)
	exitNotAcquired = 75 // --no-wait, or --wait elapsed
	exitNoPerm      = 77 // break without the privilege to terminate the holder
	exitCannotExec  = 126
	exitNotFound    = 127
)

// Stdio is the command's standard streams.
type Stdio struct {
	In       io.Reader
	Out, Err io.Writer
}

const usage = `advlock: PostgreSQL advisory locks from the shell

Usage:
  advlock run [--wait DURATION | --no-wait] [--shared] [--fence] [--grace DURATION] [--keepalive DURATION]
              [--dsn DSN] KEY [--] COMMAND [ARGS...]
  advlock ls [--json | --tree] [--watch [--interval DURATION]] [--dsn DSN] [KEY]
  advlock break [--yes] [--dsn DSN] KEY
  advlock demo [--dsn DSN]
  advlock help | --version

KEY:
  N, int:N    a 64-bit key, as pg_advisory_lock(N): decimal, optionally signed (42, -7, +3); a negative N goes
              after -- (advlock run -- -7 COMMAND) or as int:-7
  pair:A,B    two 32-bit keys, as pg_advisory_lock(A, B)
  NAME        a name, hashed to a 64-bit key (first 8 bytes of SHA-256); also name:NAME, which a name that is
              a number (name:42) or starts with a scheme below needs
  migrate:DB[/SCHEMA[/TABLE]]   golang-migrate's migration lock (schema public, table schema_migrations)
  rails:DB    Rails' migration lock for database DB
  dotnet:NAME the .NET DistributedLock library's key for NAME
  hashtext:NAME, hashtextextended:SEED:NAME
              pg_advisory_lock(hashtext(NAME)) and (hashtextextended(NAME, SEED)), computed by the server
  Schemes are lower case (Int:42 is an error). Every KEY is checked before connecting.

DURATION (--wait, --grace, --keepalive, --interval): seconds (5, 0.5, as with flock -w) or a Go duration
(1m30s, 500ms).

Connection: --dsn (before or after the command), else $DATABASE_URL, else the libpq PG* variables and defaults.

Exit status:
  run     COMMAND's status (128+N if it died of signal N); 75 not acquired (--no-wait, --wait 0, or --wait
          elapsed); 71 deadlock (the wait for KEY closed a cycle of waits); 69 database unreachable or
          refused; 70 lock lost while COMMAND ran (COMMAND got SIGTERM, then SIGKILL after --grace); 126
          COMMAND could not be run; 127 COMMAND not found; 2 usage error; 128+N if advlock got signal N before
          COMMAND started
  ls      0; 69 database unreachable; 2 usage error
  break   0 holders terminated (or none held KEY); 1 not confirmed; 77 no privilege to terminate;
          69 database unreachable; 2 usage error
  demo    0; 1 a step failed; 69 the server refused (no such database or role), or none answered and none
          could be started; 2 usage error
`

// Main runs the advlock command and returns its exit status.
func Main(ctx context.Context, args []string, std Stdio) int {
	// --dsn before the command (advlock --dsn X ls) is the command's --dsn.
	var global []string
	for len(args) > 0 {
		name, _, hasValue := strings.Cut(strings.TrimLeft(args[0], "-"), "=")
		if !strings.HasPrefix(args[0], "-") || name != "dsn" {
			break
		}
		if hasValue {
			global, args = append(global, args[0]), args[1:]
			continue
		}
		if len(args) < 2 {
			return usageError(std, "--dsn needs a value")
		}
		global, args = append(global, args[0], args[1]), args[2:]
	}
	if len(args) == 0 {
		fmt.Fprint(std.Err, usage)
		return exitUsage
	}
	if len(global) > 0 {
		switch args[0] {
		case "run", "ls", "break", "demo":
			args = append([]string{args[0]}, append(global, args[1:]...)...)
		default:
			return usageError(std, "--dsn goes with run, ls, break or demo")
		}
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		fmt.Fprint(std.Out, usage)
		return exitOK
	case "--version", "-version", "version":
		fmt.Fprintln(std.Out, "advlock", version())
		return exitOK
	case "run":
		return runCmd(ctx, args[1:], std)
	case "ls":
		return lsCmd(ctx, args[1:], std)
	case "break":
		return breakCmd(ctx, args[1:], std)
	case "demo":
		return demoCmd(ctx, args[1:], std)
	case demoWorkerCmd:
		return demoWorker(ctx, args[1:], std)
	case guardCmd:
		return guardMain(args[1:], std)
	}
	fmt.Fprintf(std.Err, "advlock: unknown command %q; see advlock --help\n", args[0])
	return exitUsage
}

func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "devel"
}

// newFlags makes a subcommand's flag set; -h prints its usage line and flags to stdout (see parsed). It writes
// nothing while it parses: its messages, and its usage, would bury the line that says what was wrong.
func newFlags(name, synopsis string, more ...string) *flag.FlagSet {
	fs := flag.NewFlagSet("advlock "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: advlock %s %s\n", name, synopsis)
		fs.PrintDefaults()
		for _, m := range more {
			fmt.Fprint(fs.Output(), m)
		}
	}
	return fs
}

// parse parses flags; it returns a status to exit with when parsing ends the command: -h prints the usage to
// stdout (exit 0), a bad flag prints one line to stderr (exit 2; see flagError).
// Flags may also come after the arguments (advlock ls KEY --tree); after -- everything is an argument. The
// arguments are then fs.Args().
func parse(fs *flag.FlagSet, args []string, std Stdio) (int, bool) {
	var pos []string
	for {
		if code, done := parsed(fs, std, fs.Parse(args)); done {
			return code, true
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			pos = append(pos, rest...)
			break
		}
		pos, args = append(pos, rest[0]), rest[1:]
	}
	_ = fs.Parse(append([]string{"--"}, pos...)) // leaves pos as fs.Args()
	return 0, false
}

// parsed ends the command when parsing its flags (by fs.Parse, or by run's runArgs) failed with err, or the flags
// asked for help.
func parsed(fs *flag.FlagSet, std Stdio, err error) (int, bool) {
	switch {
	case errors.Is(err, flag.ErrHelp):
		fs.SetOutput(std.Out)
		fs.Usage()
		return exitOK, true
	case err != nil:
		fmt.Fprintln(std.Err, flagError(fs, err))
		return exitUsage, true
	}
	return 0, false
}

// flagError renders a flag that did not parse as one line that names the flag, for a duration the forms it takes,
// and points to the command's help: advlock: run: invalid --wait "abc": want seconds (5, 0.5) or a duration
// (1m30s); see advlock run --help. Its prefix is that of every other message of the command (advlock: run:).
func flagError(fs *flag.FlagSet, err error) string {
	msg := err.Error()
	fs.VisitAll(func(f *flag.Flag) {
		if v, ok := f.Value.(*durationValue); ok && v.refused != nil {
			msg = fmt.Sprintf("invalid --%s %q: want seconds (5, 0.5) or a duration (1m30s)", f.Name, *v.refused)
		}
	})
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: -"); ok {
		name = strings.TrimPrefix(name, "-")
		msg = "unknown flag --" + name
		if isInteger("-" + name) {
			// A negative KEY.
			msg = fmt.Sprintf("unknown flag -%s: a negative KEY goes after -- (%s -- -%s ...) or as int:-%s",
				name, fs.Name(), name, name)
		} else if f := similarFlag(fs, name); f != "" {
			msg += "; did you mean --" + f + "?"
		}
	}
	return fmt.Sprintf("%s: %s; see %s --help", msgPrefix(fs), msg, fs.Name())
}

// similarFlag returns the flag of fs that name misspells by its dashes or letter case (--nowait, --No-Wait for
// --no-wait), or "".
func similarFlag(fs *flag.FlagSet, name string) string {
	norm := func(s string) string { return strings.ToLower(strings.NewReplacer("-", "", "_", "").Replace(s)) }
	found := ""
	fs.VisitAll(func(f *flag.Flag) {
		if norm(f.Name) == norm(name) {
			found = f.Name
		}
	})
	return found
}

// isInteger reports whether s is a decimal integer, optionally signed.
func isInteger(s string) bool {
	s = strings.TrimLeft(s, "+-")
	if s == "" {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// badValue reports a flag value that parsed but is out of range, as flagError does (exit 2).
func badValue(fs *flag.FlagSet, std Stdio, name, why string) int {
	fmt.Fprintf(std.Err, "%s: invalid --%s %s: %s; see %s --help\n", msgPrefix(fs), name, fs.Lookup(name).Value, why, fs.Name())
	return exitUsage
}

// msgPrefix is what the command's messages start with: "advlock: run" for the flag set "advlock run".
func msgPrefix(fs *flag.FlagSet) string { return strings.Replace(fs.Name(), " ", ": ", 1) }

// durationFlag defines a duration flag that also takes a plain number of seconds, as flock -w does: 5 is 5s, 0.5
// is 500ms; 1m30s, 500ms and the other forms of time.ParseDuration work too.
func durationFlag(fs *flag.FlagSet, name string, value time.Duration, usage string) *time.Duration {
	d := value
	fs.Var(&durationValue{d: &d}, name, usage)
	return &d
}

type durationValue struct {
	d       *time.Duration
	refused *string // the text Set refused, for flagError
}

func (v *durationValue) String() string {
	if v.d == nil { // the zero value flag.PrintDefaults makes
		return time.Duration(0).String()
	}
	return v.d.String()
}

func (v *durationValue) Set(s string) error {
	d, err := parseDuration(s)
	if err != nil {
		v.refused = &s
		return err
	}
	*v.d = d
	return nil
}

// parseDuration reads a plain decimal number (5, 0.5, .5, -1) as seconds, anything else as time.ParseDuration
// does.
func parseDuration(s string) (time.Duration, error) {
	digits, dots := 0, 0
	for i, c := range s {
		switch {
		case c >= '0' && c <= '9':
			digits++
		case c == '.':
			dots++
		case (c == '-' || c == '+') && i == 0:
		default:
			return time.ParseDuration(s)
		}
	}
	if digits > 0 && dots <= 1 {
		return time.ParseDuration(s + "s")
	}
	return time.ParseDuration(s)
}

func usageError(std Stdio, format string, a ...any) int {
	fmt.Fprintf(std.Err, "advlock: "+format+"\n", a...)
	return exitUsage
}

// connString picks the connection string (--dsn, then $DATABASE_URL, then "" for pgx's defaults and the PG*
// variables) and checks that it parses. One that does not is a usage error (exit 2), reported without the string
// or any part of it, since it may hold a password.
func connString(std Stdio, cmd, flagDSN string) (conn string, code int, bad bool) {
	conn, from := flagDSN, "--dsn"
	if conn == "" {
		conn, from = os.Getenv("DATABASE_URL"), "$DATABASE_URL"
	}
	if conn == "" {
		from = "the PG* variables"
	}
	cfg, err := pgxpool.ParseConfig(conn)
	if err == nil {
		// A URL whose password holds an unescaped '@' parses with part of the password in the host, which a
		// connection error would then print.
		err = session.CheckDSN(&cfg.ConnConfig.Config)
	}
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: %s: cannot parse the connection string from %s (not shown: it may hold a "+
			"password); write it as a URL, postgres://user@host:port/db (with '@' in a password written %%40), or "+
			"as key=value pairs\n", cmd, from)
		return "", exitUsage, true
	}
	return conn, 0, false
}

// open connects a Locker for the command, named in pg_stat_activity by app: advlock.Open does not connect, so a
// Ping proves the server answers (a database down or refusing is exit 69 before anything else is tried).
func open(ctx context.Context, conn, app string, opts ...advlock.Option) (*advlock.Locker, error) {
	if len(app) > 63 {
		app = app[:63]
	}
	opts = append(opts, advlock.WithPoolConfig(func(c *pgxpool.Config) {
		if c.ConnConfig.RuntimeParams["application_name"] == "advlock" {
			c.ConnConfig.RuntimeParams["application_name"] = app
		}
	}))
	l, err := advlock.Open(ctx, conn, opts...)
	if err != nil {
		return nil, err
	}
	if err := l.Ping(ctx); err != nil { // bounded by DefaultConnectTimeout unless conn sets connect_timeout
		l.Close()
		return nil, err
	}
	return l, nil
}

// describe renders an error for people. pgx already redacts passwords in its errors; nothing here prints a DSN.
func describe(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return strings.TrimPrefix(err.Error(), "advlock: ") + " (needs superuser, the pg_signal_backend role, or membership in the holder's role)"
	}
	return strings.TrimPrefix(err.Error(), "advlock: ")
}

// parseKeyArg checks a KEY argument before connecting, so that a bad KEY is a usage error (exit 2) whether or
// not the server answers. A key the server computes (hashtext:) has its text checked here and is made later, by
// resolveKey, on the connection; for it the zero Key is returned.
func parseKeyArg(s string) (advlock.Key, error) {
	k, err := advlock.ResolveKey(context.Background(), offline{}, s)
	if errors.Is(err, errOffline) {
		return advlock.Key{}, nil
	}
	return k, err
}

// offline is a Querier without a server. ResolveKey queries only for a key whose text it has read, so reaching
// offline means the text is valid.
type offline struct{}

var errOffline = errors.New("no server: the key is computed once connected")

func (offline) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, errOffline }

// resolveKey makes the key text names on a connection of its own to conn (for the keys the server computes).
func resolveKey(ctx context.Context, conn, text string) (advlock.Key, error) {
	if !advlock.NeedsServer(text) {
		return advlock.ParseKey(text)
	}
	c, err := connect(ctx, conn, "advlock")
	if err != nil {
		return advlock.Key{}, err
	}
	defer c.Close(context.WithoutCancel(ctx))
	return advlock.ResolveKey(ctx, c, text)
}

// connect opens one connection, bounded like Open's (advlock.DefaultConnectTimeout unless conn says otherwise).
func connect(ctx context.Context, conn, app string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(conn)
	if err != nil {
		return nil, err
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = advlock.DefaultConnectTimeout
	}
	cfg.RuntimeParams["application_name"] = app
	if !strings.Contains(conn, "default_query_exec_mode") {
		// No named prepared statements: through a pooler in transaction mode (the DSN of a --leases user) another
		// client's server session may already hold one of the same name (42P05).
		cfg.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
	return pgx.ConnectConfig(ctx, cfg)
}

// countOf formats n with one when it is 1, else with many: countOf(n, "%d lease", "%d leases").
func countOf(n int, one, many string) string {
	if n == 1 {
		return fmt.Sprintf(one, n)
	}
	return fmt.Sprintf(many, n)
}
