package driver

import (
	"os"
	"syscall"

	"google.golang.org/protobuf/types/known/wrapperspb"
)

func wrapInt64(v int64) *wrapperspb.Int64Value { return wrapperspb.Int64(v) }

// sameRdev tells whether two files are the same device node.
func sameRdev(a, b os.FileInfo) bool {
	as, ok1 := a.Sys().(*syscall.Stat_t)
	bs, ok2 := b.Sys().(*syscall.Stat_t)
	return ok1 && ok2 && as.Rdev != 0 && as.Rdev == bs.Rdev
}
