package harness

import (
	"os"

	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

// goBin is the go command of the toolchain running the tests: go test puts its
// GOROOT/bin first on the PATH of the test process.
func goBin() string { return "go" }

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func tail(s string, n int) string { return tools.LastLines(s, n) }
