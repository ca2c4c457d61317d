package advlockgocron_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/advlock/advlock"
	advlockgocron "github.com/advlock/advlock/contrib/gocron"
	"github.com/go-co-op/gocron/v2"
)

// A scheduler that runs its jobs only while its process leads: start the same program on several pods and one of
// them runs the jobs; if it dies or is cut off, another takes over.
func Example() {
	ctx := context.Background()
	dsn := os.Getenv("ADVLOCK_TEST_DATABASE_URL")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	locks, err := advlock.Open(ctx, dsn)
	if err != nil {
		log.Fatal(err)
	}
	defer locks.Close()
	elector := advlockgocron.NewElector(ctx, locks, "example-reports") // campaigns until Close
	defer elector.Close()
	s, err := gocron.NewScheduler(gocron.WithDistributedElector(elector))
	if err != nil {
		log.Fatal(err)
	}
	ran := make(chan struct{}, 1)
	if _, err := s.NewJob(gocron.DurationJob(20*time.Millisecond), gocron.NewTask(func() {
		select {
		case ran <- struct{}{}:
		default:
		}
	})); err != nil {
		log.Fatal(err)
	}
	s.Start()
	<-ran
	_ = s.Shutdown()
	fmt.Println("the job ran on the leader")
	// Output: the job ran on the leader
}

// Every scheduler runs its jobs, and each run takes the job's key without waiting: a scheduler that finds the key
// taken skips that run, so no two runs of one job overlap across the processes.
func ExampleNewLocker() {
	ctx := context.Background()
	locks, err := advlock.Open(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer locks.Close()
	s, err := gocron.NewScheduler(gocron.WithDistributedLocker(advlockgocron.NewLocker(locks)))
	if err != nil {
		log.Fatal(err)
	}
	if _, err := s.NewJob(gocron.DurationJob(time.Minute), gocron.NewTask(func() { fmt.Println("report") })); err != nil {
		log.Fatal(err)
	}
	s.Start()
	defer func() { _ = s.Shutdown() }()
}

var _ = scheduledJobs

// docs/locks.md, "Scheduled jobs": one run per tick on schedulers whose clocks differ.
func scheduledJobs(locks *advlock.Locker) (gocron.Scheduler, error) {
	x := advlockgocron.NewLocker(locks, advlockgocron.WithTickKeys(time.Second), advlockgocron.WithMinimumHold(800*time.Millisecond))
	s, err := gocron.NewScheduler(gocron.WithDistributedLocker(x))
	return s, err
}
