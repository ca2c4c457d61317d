// Command bench measures advlock against raw pgx, raw pgxpool, redsync (Redis) and etcd's concurrency.Mutex on
// the same workloads, interleaved in one run, and prints one table (medians of several rounds, with the ratio to
// raw pgx on a dedicated connection), plus results.csv, results.json and chart.svg in -out.
//
//	cd bench && go run .
//
// With -service it runs the service measurement instead (service.go): two processes of the request-scoped
// pattern, with a ledger that checks exclusion, and the server connections they use.
//
//	cd bench && go run . -service
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	goredislib "github.com/redis/go-redis/v9"
	"go.etcd.io/etcd/server/v3/embed"
)

var (
	flagPG       = flag.String("pg", "", "PostgreSQL URL (default $ADVLOCK_TEST_DATABASE_URL, else postgres://postgres@127.0.0.1:5432/test)")
	flagRedis    = flag.String("redis", "127.0.0.1:6379", "Redis address for redsync")
	flagRounds   = flag.Int("rounds", 3, "rounds; each runs every workload for every contender, interleaved")
	flagDur      = flag.Duration("dur", time.Second, "how long each throughput measurement runs")
	flagOut      = flag.String("out", "results", "directory for results.csv, results.json and chart.svg")
	flagCPU      = flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	flagOnly     = flag.String("only", "", "run only the contenders whose name matches this regular expression (raw pgx always runs; \"advlock Open, pool of 24\" runs only when named)")
	flagHandoffs = flag.Int("handoffs", 100, "handoff samples per round for PostgreSQL contenders (redsync and etcd take 20)")
)

func main() {
	flag.Parse()
	log.SetFlags(0)
	if *flagCPU != "" {
		f, err := os.Create(*flagCPU)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}
	ctx := context.Background()
	if *flagService || *flagServiceChild >= 0 {
		if err := runService(ctx); err != nil {
			log.Fatal(err)
		}
		return
	}
	e, cleanup, err := setup(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	cs := contenders(e)
	re := regexp.MustCompile("^$")
	if *flagOnly != "" {
		if re, err = regexp.Compile(*flagOnly); err != nil {
			log.Fatal(err)
		}
	}
	cs = slices.DeleteFunc(cs, func(c contender) bool {
		return c.name != rawName && (*flagOnly != "" || c.optIn) && !re.MatchString(c.name)
	})
	if slices.ContainsFunc(cs, func(c contender) bool { return c.polls }) {
		vacuumLeases(ctx, e.pgURL)
	}
	res := run(ctx, e, cs)
	res.print(os.Stdout)
	if err := res.write(*flagOut); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("\nwrote %s, %s and %s\n", filepath.Join(*flagOut, "results.csv"), filepath.Join(*flagOut, "results.json"),
		filepath.Join(*flagOut, "chart.svg"))
}

// setup checks PostgreSQL and Redis and starts an embedded etcd server in a temporary directory.
func setup(ctx context.Context) (*env, func(), error) {
	pgURL := *flagPG
	if pgURL == "" {
		pgURL = os.Getenv("ADVLOCK_TEST_DATABASE_URL")
	}
	if pgURL == "" {
		pgURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	c, err := pgx.Connect(ctx, pgURL)
	if err != nil {
		return nil, nil, fmt.Errorf("PostgreSQL at -pg: %w", err)
	}
	c.Close(ctx)
	rc := goredislib.NewClient(&goredislib.Options{Addr: *flagRedis, PoolSize: 64})
	if err := rc.Ping(ctx).Err(); err != nil {
		return nil, nil, fmt.Errorf("Redis at %s: %w (start it: redis-server --daemonize yes --port 6379 --save '')", *flagRedis, err)
	}
	dir, err := os.MkdirTemp("", "advlock-bench-etcd-")
	if err != nil {
		return nil, nil, err
	}
	cfg := embed.NewConfig()
	cfg.Dir = dir
	cfg.LogLevel = "error"
	cu, pu, err := freeURL(), freeURL(), error(nil)
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{cu}, []url.URL{cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	etcd, err := embed.StartEtcd(cfg)
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, fmt.Errorf("embedded etcd: %w", err)
	}
	select {
	case <-etcd.Server.ReadyNotify():
	case <-time.After(30 * time.Second):
		etcd.Close()
		os.RemoveAll(dir)
		return nil, nil, fmt.Errorf("embedded etcd not ready in 30s")
	}
	poolURL := pgURL + "&pool_max_conns=64"
	if !strings.Contains(pgURL, "?") {
		poolURL = pgURL + "?pool_max_conns=64"
	}
	bouncerURL, stopBouncer := startBouncer(ctx, pgURL)
	return &env{pgURL: pgURL, bouncerURL: bouncerURL, poolURL: poolURL, redis: rc, etcdURLs: []string{cu.String()}}, func() {
		stopBouncer()
		rc.Close()
		etcd.Close()
		os.RemoveAll(dir)
	}, nil
}

func freeURL() url.URL {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	return url.URL{Scheme: "http", Host: l.Addr().String()}
}
