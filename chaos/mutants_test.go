package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/advlock/advlock/internal/mutant"
)

// metTries is how many campaigns, each with the next seed, a mutant whose moment a campaign may miss gets to meet it:
// a suite run's pgbouncer_stall campaigns missed lease_renew_no_deadline's three times in a row (about two seeds in
// five miss it), and its partition campaigns miss it more often: 4 and 3 seeds in a row by hand on an idle machine
// (with the renewal loop as it was before a lease waited for it, and as it is), all 5 in a CI run. So eight.
const metTries = 8

// TestMutants is the mutation suite: the library built with one deliberate bug at a time (the tag advlock_mutants;
// never in a normal build), each run as a short campaign, which must end with a violation of the class that bug
// breaks. A mutant the checker misses fails the test. The seed changes from run to run (it is logged): the checker
// must catch a mutant whatever the workers' choices.
func TestMutants(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the library with its mutants and starts private clusters (-short)")
	}
	t.Parallel() // beside the bounded campaign
	bin := filepath.Join(t.TempDir(), "chaos.mutants")
	if out, err := exec.Command("go", "test", "-c", "-tags", "advlock_mutants", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building the workers with the mutants: %v\n%s", err, out)
	}
	seed := uint64(time.Now().UnixNano() % 1_000_000)
	// Short campaigns, each aimed at its bugs, each with a control: the same build, no mutant on, must find nothing
	// under the same workload.
	plain := Options{NoFaults: true} // exclusion, semaphores, leaks
	// Two goroutines of one worker in one key's section at once: a loaded machine (every package's tests at once)
	// made none in 10 s of one suite run, so this one runs longer.
	guardOff := Options{NoFaults: true, Duration: 20 * time.Second}
	terminate := Options{Faults: []string{"terminate_holder"}, Ops: []string{"hold", "hold_try"}} // losses inside long sections
	// A silent loss is caught only by a loss early in a long section on the session kind at fault: with the workers
	// taking turns, a suite run's terminates hit the shared worker's holders twice, both late in their sections, and
	// missed silent_loss_shared. Each kind's mutant runs with every worker on its kind, beside a control of its own.
	terminateShared, terminateDedicated := withSessions(terminate, "shared"), withSessions(terminate, "dedicated")
	cancels := Options{NoFaults: true, Ops: []string{"lock_cancel"}}                                                   // waits cancelled as the key is granted
	pairs := Options{NoFaults: true, Ops: []string{"pair"}, DeadlockBound: suiteDeadlockBound}                         // two keys in a random order: cycles of waits
	failover := Options{Failover: true, Faults: []string{"failover"}, Ops: []string{"do", "trylock", "lock_deadline"}} // a lagging standby promoted
	// Readers that come and go, writers behind them; each wait's slices shorter than the readers' holds, which
	// readers that ignore a writer's intent then outlast, one slice after another.
	queue := Options{NoFaults: true, Ops: []string{"reader", "writer"}, WaitSlice: 300 * time.Millisecond}
	// Many writers of one key, each waiting behind the others across several slices: waits that go to the back of
	// the server's queue at each slice's end are overtaken by later ones.
	crowd := Options{NoFaults: true, Ops: []string{"crowd"}, WaitSlice: 300 * time.Millisecond}
	// Leases: holders and takeovers with leases broken under them; the plain workload (tokens).
	leasesPlain := Options{NoFaults: true, Leases: true}
	leasesBroken := Options{Leases: true, Faults: []string{"break_lease"}, Ops: []string{"hold", "hold_try", "trylock"}}
	// Leases across a failover: grants and renewals the lagging standby never received, then takers on the promoted
	// server.
	leasesFailover := Options{Leases: true, Failover: true, Faults: []string{"failover"}, Ops: []string{"hold", "hold_try", "trylock", "do"}}
	// What time does to leases, each fault with the mutant it alone catches: answers that come later than a lease
	// length (a grant handed out late, then renewed: its record changes long after the one before), the server's
	// clock stepping (a takeover by the server's expiry while the holder renews: two holders), PgBouncer stopped
	// with renewals in it (a renewal without its latest moment renews a lease its holder has stopped trusting).
	leaseOps := []string{"hold", "hold_try", "trylock", "lock_deadline"}
	// Long waits, so that the worker whose answers come late is still first in a key's queue when the key is broken
	// from under its holder.
	leasesLate := Options{Leases: true, Via: []string{"proxy"}, Faults: []string{"late_answers"}, Ops: []string{"hold_wait", "hold_try"}}
	leasesClock := Options{Leases: true, Faults: []string{"clock_step"}, Ops: leaseOps, Duration: 15 * time.Second}
	// No waits: with "hold" in the mix, three campaigns in a row under CI's load had no renewal that PgBouncer
	// delivered late (a wait's polls, stalled in PgBouncer, likely take the pool's idle connections first, and a
	// renewal that must connect anew never reaches it); without waits, 4 of 5 campaigns on a loaded machine had one
	// or more.
	leasesStall := Options{Leases: true, Via: []string{"pgbouncer"}, Faults: []string{"pgbouncer_stall"}, Ops: []string{"hold_try", "trylock"},
		Duration: 15 * time.Second}
	// Crashes of the server (immediate stops), each right after a grant: the grants and renewals they take back
	// (committed without waiting for their WAL to be flushed), and the log's records of them, must not read as
	// phantoms, leases that lapsed or renewals acted on late; short sections and waits, so that grants come
	// between the crashes, past each one's quiet period.
	leasesCrash := Options{Leases: true, Faults: []string{"restart_immediate"}, Ops: []string{"trylock", "lock_deadline", "hold_try"},
		Duration: 15 * time.Second}
	// met says, for a mutant whose moment a campaign may miss, whether it met it: one that did not runs again with
	// the next seed (at most metTries campaigns), and one that met it must catch the mutant. A grant made while its worker's
	// answers came late: the moment lease_late_grant_kept hands one out late.
	grantedLate := func(r *Report) bool { return r.LateAnswerGrants > 0 }
	// A renewal held back by a stall past its trust: the campaign counts no such renewal, and a seed whose stalls
	// hit none shows nothing (twice in five runs of one day), so a seed that brought no revival runs again with the
	// next one, at most metTries campaigns; the control (leasesStall with no mutant) shows a revival is not the stall's own.
	renewedLate := func(r *Report) bool { return r.ViolationsByKind[VRevived] > 0 }
	// A partition past a lease length, as TCP lives through it: renewals, releases and the statements of calls
	// that gave up arrive late, after their senders gave up on them, and must change nothing a holder relies on
	// (the mutant's renewal, without its latest moment, revives a lease its holder stopped trusting).
	leasesPartition := Options{Leases: true, Via: []string{"proxy"}, Faults: []string{"partition"}, Ops: []string{"hold", "hold_try", "trylock"},
		Duration: 15 * time.Second}
	// A lease swept under its holder at a step forward: it shows only when another worker is granted the key before
	// the holder's next renewal tells it (overlap), or the holder is told late. A Locker renews its leases together,
	// each up to half a period early, so that renewal comes soon: a suite run's campaign swept 7 holders' leases,
	// each told within 163 ms, with no grant between (two campaigns by hand the same day: overlap 2 and 5). A
	// campaign that showed neither runs again with the next seed, at most metTries; its control shows neither comes of
	// the steps themselves.
	sweptLive := func(r *Report) bool { return r.ViolationsByKind[VOverlap]+r.ViolationsByKind[VLateNotice] > 0 }
	// A later crowd wait let past an earlier one (a suite run's 10 s campaign under CI's load showed none). Nothing in
	// the records tells a campaign whose waits gave the mutant its moment from one whose did not: the chances to
	// overtake it counts (Report.OvertakeChances, logged) were as many in the controls (32 to 83 by hand) as with the
	// mutant (33 to 51, each caught). So a campaign that did not catch it runs again with the next seed, and the case
	// fails when none of metTries did.
	queuedBehind := func(r *Report) bool { return r.ViolationsByKind[VOvertaken] > 0 }
	met := map[string]func(*Report) bool{mutant.LeaseLateGrantKept: grantedLate, mutant.LeaseRenewNoDeadline: renewedLate,
		mutant.LeaseSweepServerExpiry: sweptLive, mutant.WaitRequeueBack: queuedBehind}
	cases := []struct {
		mutant string
		opt    Options
		want   []string // any of these classes catches it
	}{
		{"", plain, nil},
		{mutant.GuardOff, guardOff, []string{VOverlap}},
		{mutant.LeadShared, plain, []string{VOverlap}},
		{mutant.SemaphoreExtraSlot, plain, []string{VSemaphore}},
		{mutant.UnlockSkippedShared, plain, []string{VLeak}},
		{mutant.UnlockSkippedDedicated, plain, []string{VLeak}},
		{"", terminateDedicated, nil},
		{mutant.SilentLossDedicated, terminateDedicated, []string{VNeverTold, VLateNotice}},
		{"", terminateShared, nil},
		{mutant.SilentLossShared, terminateShared, []string{VNeverTold, VLateNotice}},
		{"", cancels, nil},
		{mutant.CancelGrantDropped, cancels, []string{VLeak}},
		{"", pairs, nil},
		{mutant.DeadlockUndetected, pairs, []string{VDeadlockHang}},
		{mutant.DeadlockEveryMember, pairs, []string{VDoubleDeadlock}},
		{mutant.DeadlockFalse, pairs, []string{VFalseDeadlock}},
		{"", failover, nil},
		{mutant.TokenNoTimeline, failover, []string{VTokenOrder, VStaleToken}},
		{"", queue, nil},
		{"", crowd, nil},
		{mutant.WaitRequeueBack, crowd, []string{VOvertaken}},
		{"", leasesPlain, nil},
		{mutant.LeaseTermReused, leasesPlain, []string{VStaleToken, VTokenOrder}},
		{"", leasesBroken, nil},
		{mutant.LeaseRenewUnkeyed, leasesBroken, []string{VOverlap, VNeverTold, VLateNotice}},
		{"", leasesFailover, nil},
		{"", leasesLate, nil},
		{mutant.LeaseLateGrantKept, leasesLate, []string{VRevived, VOverlap, VLateNotice}},
		{"", leasesClock, nil},
		{mutant.LeaseServerExpiry, leasesClock, []string{VOverlap}},
		// The sweep deletes the holder's row under it at a step forward: the holder learns it only at its next
		// renewal (late_notice), and another worker may be granted the key before then (overlap).
		{mutant.LeaseSweepServerExpiry, leasesClock, []string{VOverlap, VLateNotice}},
		{"", leasesStall, nil},
		{mutant.LeaseRenewNoDeadline, withDuration(leasesStall, 0), []string{VRevived}}, // 25 s: several stalls past a lease length
		{"", leasesPartition, nil},
		{"", leasesCrash, nil},
		{mutant.LeaseRenewNoDeadline, leasesPartition, []string{VRevived}},
	}
	// Mutants whose moment a short campaign meets too seldom to be sure of it: each is caught by the test written
	// for that moment, run in the build with the mutants (and passing without one).
	tests := []struct {
		mutant, test string // a test of the root package
	}{
		// A renewal answered late, then silence: the holder that counts its trust from the answer trusts past
		// the expiry the server gave, and a waiter is granted while it does.
		{mutant.LeaseTrustFromReply, "TestLeaseTrustCountedFromSend"},
		// A failover that lost a grant: the promoted server has no row for the key, and grants it at once without
		// the quiet period (its table of restarts is empty) while the lost grant's holder still trusts it. (A campaign's failover meets that moment
		// seldom: a row the promoted server has, even an old one, is taken over only after a lease length's watch.)
		{mutant.LeaseNoRestartQuiet, "TestLeaseFailover"},
		// A crash that took back a grant whose holder still trusts it, on a server that grants its key at once after
		// the restart (no quiet period), or hands out the lost grant's term again (the fencing sequence not moved
		// past it). A campaign's crash meets that moment seldom: the WAL writer writes out what a grant wrote within
		// a second (and the first grant after a crash flushes it all), and the grant's holder must still be in its
		// section when the server is back (mutant campaigns of 20 s by hand, each crash right after a grant, took
		// back 0 to 7 grants each and caught neither mutant).
		{mutant.LeaseNoRestartQuiet, "TestLeaseCrashLosesGrant"},
		{mutant.LeaseRestartTermKept, "TestLeaseCrashLosesGrant"},
		// A grant that reaches the server after its caller gave up and after its undo: a lease held by nobody.
		{mutant.LeaseGrantNoDeadline, "TestLeaseLateRequestGrantsNothing"},
		// A grant whose answer was lost, undone once while the link was down: a lease held by nobody.
		{mutant.LeaseUndoOnce, "TestLeaseUndoneOnceTheLinkIsBack"},
		// A shared session that holds a key shared is granted it again past a writer (PostgreSQL's re-entrancy),
		// unless the writer's intent refuses it. (The campaign's readers behind a writer wait in its key's line, so
		// readers that come and go starve a writer without the intent only between two of its slices: seldom.)
		{mutant.IntentIgnored, "TestWriterIntent"},
		// A wait of a cycle between two sessions (it gave its session up to another wait of its Locker) when its
		// Locker reads the graph, while the other Locker's readings saw it in the server: each Locker ends its own
		// wait. (The campaign's pairs met it once in a suite run: double_deadlock.)
		{mutant.DeadlockStaleChoice, "TestDeadlockWaitBetweenSessions"},
		// A Locker whose readings see a cycle one way and then the other by turns: it ends its wait on two readings
		// that chose it with one between that chose the wait every other client chooses.
		{mutant.DeadlockChoiceKept, "TestDeadlockChoiceFlips"},
		// A wait chosen on one reading of a cycle and on one of the next cycle through it, which formed as the
		// first one's victim let go: it ends on one reading of the new cycle. (The campaign's pairs met it in a
		// 15-minute campaign of pairs by hand, twice, as double_deadlock: three-wait cycles, 0.29 s between the
		// first cycle's victim and this wait.)
		{mutant.DeadlockOtherCycle, "TestDeadlockCountsOneCycle"},
		// A wait of a Locker that left the server a moment ago, which the other clients' readings no longer show,
		// draws its Locker's choice to another of its waits while they end another wait of the same cycle.
		{mutant.DeadlockRecentChooses, "TestDeadlockRecentWaitChoosesNothing"},
	}
	covered := map[string]bool{}
	for _, c := range cases {
		covered[c.mutant] = true
	}
	for _, c := range tests {
		covered[c.mutant] = true
	}
	for _, m := range mutant.All {
		if !covered[m] {
			t.Errorf("mutant %s has no case", m)
		}
	}
	// A few campaigns or tests at a time (lanes); the controls, run the same way, show that the checker finds
	// nothing in a build without a mutant.
	// The tests' package is built once with the mutants, beside the campaigns.
	var build sync.Once
	var testBin string
	var buildErr error
	for _, c := range tests {
		t.Run(c.mutant+"/"+c.test, func(t *testing.T) {
			t.Parallel()
			lane(t)
			build.Do(func() {
				testBin = filepath.Join(filepath.Dir(bin), "root.mutants")
				out, err := exec.Command("go", "test", "-c", "-tags", "advlock_mutants", "-o", testBin, "..").CombinedOutput()
				if err != nil {
					buildErr = fmt.Errorf("building the root package with the mutants: %v\n%s", err, out)
				}
			})
			if buildErr != nil {
				t.Fatal(buildErr)
			}
			cmd := exec.Command(testBin, "-test.count=1", "-test.run", "^"+c.test+"$")
			cmd.Dir = ".." // the package's own directory, as go test runs it
			cmd.Env = append(os.Environ(), mutant.Env+"="+c.mutant)
			if out, err := cmd.CombinedOutput(); err == nil {
				t.Errorf("%s passed with mutant %s on: it does not catch it\n%s", c.test, c.mutant, out)
			} else if !strings.Contains(string(out), "--- FAIL: "+c.test) {
				t.Errorf("%s with mutant %s on did not fail as a test fails (%v): it proves nothing\n%s", c.test, c.mutant, err, out)
			}
		})
	}
	for _, c := range cases {
		name := c.mutant
		if name == "" {
			name = "none"
		}
		if c.opt.Leases {
			name += "/leases"
		}
		if c.opt.Sessions != "" {
			name += "/" + c.opt.Sessions
		}
		switch {
		case c.opt.Faults != nil:
			name += "/" + strings.Join(c.opt.Faults, ",")
		case c.opt.Ops != nil:
			name += "/" + strings.Join(c.opt.Ops, ",")
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			lane(t)
			opt := c.opt
			opt.Seed, opt.Workers, opt.Mutant, opt.Binary = seed, 2, c.mutant, bin
			switch {
			case opt.Duration != 0: // the case's own
			case c.opt.Faults != nil && c.mutant != "" && !c.opt.Failover: // a failover comes within seconds
				opt.Duration = 25 * time.Second // a loss must land early in a long section on the session kind at fault
			default:
				opt.Duration = 10 * time.Second
			}
			r, err := Run(context.Background(), opt)
			metMoment := met[c.mutant] // none for a control (no mutant)
			for try := 1; err == nil && metMoment != nil && !metMoment(r) && try < metTries; try++ {
				t.Logf("seed %d: the campaign did not meet mutant %s's moment (%d chances to overtake); again with seed %d",
					opt.Seed, c.mutant, r.OvertakeChances, opt.Seed+1)
				os.RemoveAll(r.Dir)
				opt.Seed++
				r, err = Run(context.Background(), opt)
			}
			if err != nil {
				t.Fatal(err)
			}
			if metMoment != nil && !metMoment(r) {
				var b strings.Builder
				r.Print(&b)
				t.Log("\n" + b.String())
				t.Fatalf("seed %d: %d campaigns never met mutant %s's moment: the test proves nothing", opt.Seed, metTries, c.mutant)
			}
			var b strings.Builder
			r.Print(&b)
			if c.want == nil {
				// A short run with one kind of fault may not exercise everything: only violations count here.
				if r.Violations > 0 {
					t.Log("\n" + b.String())
					t.Fatalf("seed %d: the build with the mutants, none on: %v", seed, r.ViolationsByKind)
				}
				os.RemoveAll(r.Dir)
				return
			}
			caught := false
			for _, k := range c.want {
				caught = caught || r.ViolationsByKind[k] > 0
			}
			if !caught {
				t.Log("\n" + b.String())
				t.Fatalf("seed %d: the checker missed mutant %s (want a violation of %v; got %v)", seed, c.mutant, c.want, r.ViolationsByKind)
			}
			t.Logf("seed %d: mutant %s caught: %v", seed, c.mutant, r.ViolationsByKind)
			os.RemoveAll(r.Dir) // kept because something was found; here that was the point
		})
	}
}

// withDuration is opt with another duration (0: the suite's default for its kind).
func withSessions(opt Options, kind string) Options {
	opt.Sessions = kind
	return opt
}

func withDuration(opt Options, d time.Duration) Options {
	opt.Duration = d
	return opt
}
