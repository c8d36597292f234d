package fake_test

import (
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/layout"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
)

// The fake stands in for every interface of layout.Host, and for the node
// the health checks read.
var (
	_ health.Node         = (*fake.Host)(nil)
	_ layout.MountTable   = (*fake.Host)(nil)
	_ layout.LoopDevices  = (*fake.Host)(nil)
	_ layout.BlockDevices = (*fake.Host)(nil)
	_ layout.Filesystems  = (*fake.Host)(nil)
)
