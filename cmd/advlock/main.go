// Command advlock runs commands under PostgreSQL advisory locks and shows who holds and waits for them.
//
//	advlock run [--wait DURATION | --no-wait] [--shared] KEY -- COMMAND [ARGS...]
//	advlock ls [--json] [KEY]
//	advlock break [--yes] KEY
//	advlock demo
//
// See advlock help, and docs/command.md, for every flag and exit status.
package main

import (
	"context"
	"os"

	"github.com/advlock/advlock/internal/cli"
)

func main() {
	os.Exit(cli.Main(context.Background(), os.Args[1:], cli.Stdio{In: os.Stdin, Out: os.Stdout, Err: os.Stderr}))
}
