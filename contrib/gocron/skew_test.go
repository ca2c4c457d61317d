package advlockgocron

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/advlock/advlock"
	"github.com/advlock/advlock/internal/testkit/pgtest"
	"github.com/go-co-op/gocron/v2"
	"github.com/jackc/pgx/v5"
	"github.com/jonboulle/clockwork"
)

// skewed is the real clock moved by an offset: a scheduler on a machine whose clock is off.
type skewed struct {
	clockwork.Clock
	off time.Duration
}

func (c skewed) Now() time.Time                  { return time.Now().Add(c.off) }
func (c skewed) Since(t time.Time) time.Duration { return c.Now().Sub(t) }
func (c skewed) Until(t time.Time) time.Duration { return t.Sub(c.Now()) }

const (
	skewTicks = 20
	envPod    = "ADVLOCK_GOCRON_POD" // pod number, clock offset (ms), first tick (Unix s), table, URL
)

// Three schedulers in three processes, their clocks 250 ms apart (-250, 0, +250 ms), each running a 5 ms job at
// every second of its own clock for 20 s, with a Locker that keys each run by its tick and holds it at least
// 800 ms: exactly 20 runs in all, one per tick. The same schedulers run a 5 ms job every 2 s with the default
// Locker (the job's key, a 1 s hold): exactly 10 runs, one per tick. And they run the every-second job with the
// Locker held for the run only (no minimum hold, no tick key): that one runs it more than once for some ticks, the
// hazard this is for.
func TestSkewedSchedulers(t *testing.T) {
	if spec := os.Getenv(envPod); spec != "" {
		runPod(t, spec)
		return
	}
	if testing.Short() {
		t.Skip("three scheduler processes for 20 s")
	}
	url := pgtest.URL(t)
	obs := pgtest.Conn(t, url)
	ctx := context.Background()
	table := fmt.Sprintf("gocron_skew_%d", time.Now().UnixNano())
	if _, err := obs.Exec(ctx, "CREATE TABLE "+table+" (job text NOT NULL, tick bigint NOT NULL, pod int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	defer obs.Exec(context.Background(), "DROP TABLE "+table)
	first := time.Now().Add(4 * time.Second).Truncate(time.Second).Unix() // time for the processes to start
	var cmds []*exec.Cmd
	var outs []*strings.Builder
	for i, off := range []int{-250, 0, 250} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestSkewedSchedulers$", "-test.v")
		cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d,%d,%d,%s,%s", envPod, i, off, first, table, url))
		out := &strings.Builder{}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs = append(cmds, cmd), append(outs, out)
	}
	for i, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			t.Errorf("pod %d: %v\n%s", i, err, outs[i])
		}
	}
	count := func(job string) (runs int, twice []int64) {
		rows, err := obs.Query(ctx, "SELECT tick, count(*) FROM "+table+" WHERE job = $1 AND tick >= $2 AND tick < $3 GROUP BY tick ORDER BY tick",
			job, first, first+skewTicks)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var tick, n int64
			if err := rows.Scan(&tick, &n); err != nil {
				t.Fatal(err)
			}
			runs += int(n)
			if n > 1 {
				twice = append(twice, tick-first)
			}
		}
		return runs, twice
	}
	runs, twice := count("ticked")
	if runs != skewTicks || len(twice) > 0 {
		t.Errorf("with tick keys and a minimum hold: %d runs for %d ticks (ticks run twice: %v), want exactly one each", runs, skewTicks, twice)
	}
	def, defTwice := count("default")
	if def != skewTicks/2 || len(defTwice) > 0 {
		t.Errorf("a job every 2 s with the default Locker: %d runs for %d ticks (ticks run twice: %v), want exactly one each", def, skewTicks/2, defTwice)
	}
	plain, plainTwice := count("plain")
	if len(plainTwice) == 0 {
		t.Errorf("held for the run only, the job ran %d times in %d ticks and never twice in one: the test shows nothing", plain, skewTicks)
	}
	t.Logf("ticked: %d runs in %d ticks; default Locker, every 2 s: %d runs in %d ticks; held for the run only: %d runs, %d ticks run more than once",
		runs, skewTicks, def, skewTicks/2, plain, len(plainTwice))
}

// runPod is one scheduler process of TestSkewedSchedulers.
func runPod(t *testing.T, spec string) {
	f := strings.SplitN(spec, ",", 5)
	pod, _ := strconv.Atoi(f[0])
	off, _ := strconv.Atoi(f[1])
	first, _ := strconv.ParseInt(f[2], 10, 64)
	table, url := f[3], f[4]
	clock := skewed{Clock: clockwork.NewRealClock(), off: time.Duration(off) * time.Millisecond}
	ctx := context.Background()
	l, err := advlock.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	rec, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Close(ctx)
	recs := make(chan [2]any, 100)
	s, err := gocron.NewScheduler(gocron.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	jobs := map[string]*Locker{
		"ticked":  NewLocker(l, WithTickKeys(time.Second), WithMinimumHold(800*time.Millisecond), WithClock(clock.Now)),
		"default": NewLocker(l),
		"plain":   NewLocker(l, WithMinimumHold(0)),
	}
	for job, x := range jobs {
		every := "* * * * * *"
		if job == "default" {
			every = "*/2 * * * * *"
		}
		if _, err := s.NewJob(gocron.CronJob(every, true), gocron.NewTask(func() {
			recs <- [2]any{job, clock.Now().Round(time.Second).Unix()}
			time.Sleep(5 * time.Millisecond)
		}), gocron.WithName(table+"/"+job), gocron.WithDistributedJobLocker(x)); err != nil {
			t.Fatal(err)
		}
	}
	s.Start()
	end := time.Unix(first+skewTicks, 0).Add(time.Second)
	for time.Now().Before(end) {
		select {
		case r := <-recs:
			if _, err := rec.Exec(ctx, "INSERT INTO "+table+" (job, tick, pod) VALUES ($1, $2, $3)", r[0], r[1], pod); err != nil {
				t.Error(err)
			}
		case <-time.After(50 * time.Millisecond):
		}
	}
	if err := s.Shutdown(); err != nil {
		t.Error(err)
	}
	close(recs)
	for r := range recs {
		if _, err := rec.Exec(ctx, "INSERT INTO "+table+" (job, tick, pod) VALUES ($1, $2, $3)", r[0], r[1], pod); err != nil {
			t.Error(err)
		}
	}
}
