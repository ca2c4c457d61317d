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

	"github.com/advlock/advlock"
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
  advlock ls [--json | --tree] [--watch [--interval D]] [--dsn DSN] [KEY]
  advlock break [--yes] [--dsn DSN] KEY
  advlock demo
  advlock help | --version

KEY:
  NAME        a name, hashed to a 64-bit key (first 8 bytes of SHA-256); also name:NAME
  int:N       a 64-bit key, as pg_advisory_lock(N)
  pair:A,B    two 32-bit keys, as pg_advisory_lock(A, B)
  migrate:DB[/SCHEMA[/TABLE]]   golang-migrate's migration lock (schema public, table schema_migrations)
  rails:DB    Rails' migration lock for database DB
  dotnet:NAME the .NET DistributedLock library's key for NAME
  hashtext:NAME, hashtextextended:SEED:NAME
              pg_advisory_lock(hashtext(NAME)) and (hashtextextended(NAME, SEED)), computed by the server

Connection: --dsn (before or after the command), else $DATABASE_URL, else the libpq PG* variables and defaults.

Exit status:
  run     COMMAND's status (128+N if it died of signal N); 75 not acquired (--no-wait, or --wait elapsed);
          69 database unreachable or refused; 70 lock lost while COMMAND ran (COMMAND got SIGTERM, then
          SIGKILL after --grace); 126 COMMAND not executable; 127 COMMAND not found; 2 usage error;
          128+N if advlock got signal N before COMMAND started
  ls      0; 69 database unreachable; 2 usage error
  break   0 holders terminated (or none held KEY); 1 not confirmed; 77 no privilege to terminate;
          69 database unreachable; 2 usage error
  demo    0; 1 if a step failed
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
	fmt.Fprintf(std.Err, "advlock: unknown command %q\n\n%s", args[0], usage)
	return exitUsage
}

func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "devel"
}

// newFlags makes a subcommand's flag set; -h prints its usage line and flags to stdout.
func newFlags(name, synopsis string, std Stdio, more ...string) *flag.FlagSet {
	fs := flag.NewFlagSet("advlock "+name, flag.ContinueOnError)
	fs.SetOutput(std.Err)
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
// stdout (exit 0), a bad flag prints the error and the usage to stderr (exit 2).
func parse(fs *flag.FlagSet, args []string, std Stdio) (int, bool) {
	usage := fs.Usage
	fs.Usage = func() {}
	err := fs.Parse(args)
	fs.Usage = usage
	if errors.Is(err, flag.ErrHelp) {
		fs.SetOutput(std.Out)
		fs.Usage()
		return exitOK, true
	}
	if err != nil {
		fs.Usage()
		return exitUsage, true
	}
	return 0, false
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
	if err == nil && hostHasAt(cfg.ConnConfig.Config) {
		// A URL whose password holds an unescaped '@' parses with part of the password in the host, which a
		// connection error would then print.
		err = errors.New("'@' in a host")
	}
	if err != nil {
		fmt.Fprintf(std.Err, "advlock: %s: cannot parse the connection string from %s (not shown: it may hold a "+
			"password); write it as a URL, postgres://user@host:port/db (with '@' in a password written %%40), or "+
			"as key=value pairs\n", cmd, from)
		return "", exitUsage, true
	}
	return conn, 0, false
}

func hostHasAt(c pgconn.Config) bool {
	if strings.Contains(c.Host, "@") {
		return true
	}
	for _, f := range c.Fallbacks {
		if strings.Contains(f.Host, "@") {
			return true
		}
	}
	return false
}

// open connects a Locker for the command, named in pg_stat_activity by app.
func open(ctx context.Context, conn, app string, opts ...advlock.Option) (*advlock.Locker, error) {
	if len(app) > 63 {
		app = app[:63]
	}
	opts = append(opts, advlock.WithPoolConfig(func(c *pgxpool.Config) {
		if c.ConnConfig.RuntimeParams["application_name"] == "advlock" {
			c.ConnConfig.RuntimeParams["application_name"] = app
		}
	})) // Open bounds connecting by DefaultConnectTimeout unless conn sets connect_timeout
	return advlock.Open(ctx, conn, opts...)
}

// describe renders an error for people. pgx already redacts passwords in its errors; nothing here prints a DSN.
func describe(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return strings.TrimPrefix(err.Error(), "advlock: ") + " (needs superuser, the pg_signal_backend role, or membership in the holder's role)"
	}
	return strings.TrimPrefix(err.Error(), "advlock: ")
}

// parseKeyArg checks a KEY argument before connecting: the keys the server computes (hashtext) are resolved
// later, by resolveKey, on the connection.
func parseKeyArg(s string) (advlock.Key, error) {
	if advlock.NeedsServer(s) {
		return advlock.Key{}, nil
	}
	return advlock.ParseKey(s)
}

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
	return pgx.ConnectConfig(ctx, cfg)
}
