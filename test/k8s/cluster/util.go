package cluster

import (
	"os"

	"github.com/poolcsi/poolcsi/test/k8s/tools"
)

// GoBin is the go command of the toolchain running the tests: go test puts its
// GOROOT/bin first on the PATH of the test process.
func GoBin() string { return "go" }

// FileExists reports whether p exists.
func FileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// Tail is the last n lines of s.
func Tail(s string, n int) string { return tools.LastLines(s, n) }
