// Package advlocktest tests code that uses advlock against a real PostgreSQL, with real locks and real faults: the
// code under test sees exactly what production shows it, because what happens is what production does (a server
// session ended by pg_terminate_backend, another session holding the key, a network that goes silent, a server that
// restarts).
//
//	func TestReport(t *testing.T) {
//		dsn := advlocktest.DSN(t)                        // a server for the test; locks left held fail it
//		l, err := advlock.Open(t.Context(), dsn)
//		...
//		advlocktest.Hold(t, dsn, advlock.NameKey("report")) // another process holds the key
//		// the code under test answers "busy"
//		lk, _ := l.TryLock(ctx, key)
//		advlocktest.Lose(t, lk)                           // its server session ends: Done closes, Err is ErrLockLost
//	}
//
// [DSN] finds the server: the variable ADVLOCK_TEST_DATABASE_URL (or one named with [Env]), else a throwaway
// PostgreSQL started from the installed server binaries (initdb) once for the test binary and removed after it.
// Without either, the test is skipped with a message that says what to set ([Require] fails it instead).
//
// Faults, each on the user's own locks: [Lose] ends a lock's server session (or deletes its lease), [LoseKey] ends
// whatever holds a key, [Hold] holds a key from another server session until released (as a session lock and as a
// lease, so that code on either kind meets it held), a [Link] puts a Locker's
// connections behind a proxy that can cut them, go silent (a blackhole: a frozen holder, as the server and other
// processes see it) or slow down, and [StartServer] gives a test a server of its own to restart.
//
// Checks: the DSN of a test gives its sessions an application_name of their own, and when the test ends, a lock
// still held by a session of that DSN fails it (server truth, from pg_locks), and that session is ended (the check
// returns once the server has let it go, 3 s at most), as a lease left held is broken. [VerifyNoGoroutines] fails a
// test that leaves advlock's goroutines, or a pgx pool's, running (a Locker not closed).
//
// The package is for tests: it imports package testing, starts nothing when imported, and depends only on the
// standard library, pgx and advlock. Functions take a [TB], which *testing.T, *testing.B and *testing.F satisfy.
package advlocktest

import "time"

// TB is the part of testing.TB that the kit uses. *testing.T, *testing.B and *testing.F satisfy it.
type TB interface {
	Helper()
	Name() string
	Cleanup(func())
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Skipf(format string, args ...any)
}

// bound is how long a helper waits for the server or a Locker before it fails the test.
const bound = 30 * time.Second
