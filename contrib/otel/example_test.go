package advlockotel_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/advlock/advlock"
	advlockotel "github.com/advlock/advlock/contrib/otel"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// Metrics printed to stdout: a Locker with a meter provider whose reader exports to stdout.
func Example() {
	ctx := context.Background()
	exp, err := stdoutmetric.New(stdoutmetric.WithPrettyPrint())
	if err != nil {
		fmt.Println(err)
		return
	}
	reader := sdkmetric.NewPeriodicReader(exp)
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(ctx) // exports what was recorded

	dsn := os.Getenv("DATABASE_URL") // for example postgres://postgres@127.0.0.1:5432/postgres
	l, err := advlock.Open(ctx, dsn, advlockotel.WithMeterProvider(mp))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer l.Close()
	lk, err := l.TryLock(ctx, advlock.NameKey("nightly-report"))
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := lk.Unlock(ctx); err != nil {
		fmt.Println(err)
	}
}

// A Locker that reports to the global OpenTelemetry providers: metrics for every lock call and session, a span
// for each call that may wait.
func ExampleWithTracerProvider() {
	ctx := context.Background()
	dsn := os.Getenv("DATABASE_URL")
	l, err := advlock.Open(ctx, dsn,
		advlockotel.WithMeterProvider(otel.GetMeterProvider()),
		advlockotel.WithTracerProvider(otel.GetTracerProvider()))
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
}
