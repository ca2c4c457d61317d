package advlockgocron

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/go-co-op/gocron/v2"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// pod is one scheduler process: its own Locker (its own pool) and gocron scheduler.
type pod struct {
	l *advlock.Locker
	s gocron.Scheduler
}

func newPod(t *testing.T, opt func(*advlock.Locker) gocron.SchedulerOption) *pod {
	t.Helper()
	l := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	s, err := gocron.NewScheduler(opt(l))
	if err != nil {
		t.Fatal(err)
	}
	return &pod{l: l, s: s}
}

// With the Elector only the leader runs jobs; when the leader's session is terminated another pod takes over.
func TestElector(t *testing.T) {
	name := t.Name() + time.Now().Format("150405.000000")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	var runs []int // which pod ran each run, in order
	var electors []*Elector
	var pods []*pod
	for i := range 3 {
		var e *Elector
		p := newPod(t, func(l *advlock.Locker) gocron.SchedulerOption {
			e = NewElector(ctx, l, name)
			return gocron.WithDistributedElector(e)
		})
		electors, pods = append(electors, e), append(pods, p)
		if _, err := p.s.NewJob(gocron.DurationJob(20*time.Millisecond), gocron.NewTask(func() {
			mu.Lock()
			runs = append(runs, i)
			mu.Unlock()
		}), gocron.WithName("tick")); err != nil {
			t.Fatal(err)
		}
		p.s.Start()
	}
	defer func() {
		for i, p := range pods {
			_ = p.s.Shutdown()
			if err := electors[i].Close(); err != nil {
				t.Error(err)
			}
			p.l.Close()
		}
	}()
	leaderRuns := func(from int) (int, map[int]int) {
		mu.Lock()
		defer mu.Unlock()
		by := map[int]int{}
		for _, r := range runs[from:] {
			by[r]++
		}
		return len(runs), by
	}
	time.Sleep(600 * time.Millisecond)
	mark, by := leaderRuns(0)
	if len(by) != 1 || mark < 10 {
		t.Fatalf("runs by pod: %v (%d runs), want every run on one pod, the leader", by, mark)
	}
	var leader int
	for p := range by {
		leader = p
	}
	who, ok, err := advlock.Leader(ctx, pgtest.Conn(t, pgtest.URL(t)), advlock.NameKey("gocron/elector/"+name))
	if err != nil || !ok {
		t.Fatalf("Leader: %v %v", ok, err)
	}
	pgtest.Terminate(t, pgtest.Conn(t, pgtest.URL(t)), uint32(who.PID))
	time.Sleep(200 * time.Millisecond) // the deposed leader steps down; another wins
	mark, _ = leaderRuns(0)
	time.Sleep(600 * time.Millisecond)
	_, by = leaderRuns(mark)
	if len(by) != 1 {
		t.Fatalf("after the leader's session was terminated, runs by pod: %v, want one pod", by)
	}
	for p := range by {
		if p == leader {
			t.Errorf("pod %d still runs the jobs after its leadership was terminated", p)
		}
	}
	t.Logf("pod %d led, then pod(s) %v after its session was terminated", leader, by)
}

// With the Locker, no two runs of one job overlap, whichever of 3 schedulers starts them (a job every 10 ms: no
// minimum hold).
func TestLocker(t *testing.T) {
	var inside, overlaps, ran atomic.Int32
	var pods []*pod
	job := t.Name() + time.Now().Format("150405.000000") // the same job on every scheduler
	for range 3 {
		p := newPod(t, func(l *advlock.Locker) gocron.SchedulerOption {
			return gocron.WithDistributedLocker(NewLocker(l, WithMinimumHold(0))) // held for the run only
		})
		pods = append(pods, p)
		if _, err := p.s.NewJob(gocron.DurationJob(10*time.Millisecond), gocron.NewTask(func() {
			if inside.Add(1) > 1 {
				overlaps.Add(1)
			}
			time.Sleep(15 * time.Millisecond)
			inside.Add(-1)
			ran.Add(1)
		}), gocron.WithName(job), gocron.WithSingletonMode(gocron.LimitModeReschedule)); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range pods {
		p.s.Start()
	}
	time.Sleep(time.Second)
	for _, p := range pods {
		if err := p.s.Shutdown(); err != nil {
			t.Error(err)
		}
		p.l.Close()
	}
	if overlaps.Load() != 0 {
		t.Errorf("%d runs overlapped another", overlaps.Load())
	}
	if ran.Load() < 10 {
		t.Errorf("only %d runs in a second", ran.Load())
	}
	t.Logf("%d runs, %d overlaps", ran.Load(), overlaps.Load())
}

// Lock of a job another scheduler runs fails with advlock.ErrNotAcquired (gocron then skips the run).
func TestLockerBusy(t *testing.T) {
	l := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	defer l.Close()
	x := NewLocker(l)
	ctx := context.Background()
	lk, err := x.Lock(ctx, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	other := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	defer other.Close()
	if _, err := NewLocker(other).Lock(ctx, t.Name()); !errors.Is(err, advlock.ErrNotAcquired) {
		t.Errorf("Lock of a running job: %v, want ErrNotAcquired", err)
	}
	if err := lk.Unlock(ctx); err != nil {
		t.Fatal(err)
	}
}

// An Elector whose campaign ended for a reason other than Close (here its Locker was closed under it; a pooler in
// transaction mode or a missing privilege for fencing do the same) says so from IsLeader, instead of "not leader"
// for ever: no process may be leading.
func TestElectorEnded(t *testing.T) {
	l := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	l.Close()
	e := NewElector(context.Background(), l, "ended")
	var err error
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if err = e.IsLeader(context.Background()); !errors.Is(err, ErrNotLeader) {
			break
		}
	}
	if !errors.Is(err, advlock.ErrClosed) || errors.Is(err, ErrNotLeader) {
		t.Errorf("IsLeader after the campaign ended: %v, want the campaign's error (ErrClosed)", err)
	}
	if cerr := e.Close(); !errors.Is(cerr, advlock.ErrClosed) {
		t.Errorf("Close: %v, want the campaign's error", cerr)
	}
	// Closed by Close: IsLeader says not leader, Close nil.
	live := advlock.New(pgtest.Pool(t, pgtest.URL(t), nil))
	defer live.Close()
	e = NewElector(context.Background(), live, "closed")
	if err := e.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := e.IsLeader(context.Background()); !errors.Is(err, ErrNotLeader) {
		t.Errorf("IsLeader after Close: %v, want ErrNotLeader", err)
	}
}
