package fake_test

import (
	"github.com/poolcsi/poolcsi/internal/driver"
	"github.com/poolcsi/poolcsi/internal/health"
	"github.com/poolcsi/poolcsi/internal/mount/fake"
)

// The fake stands in for every interface of driver.Host, and for the node
// the health checks read.
var (
	_ health.Node         = (*fake.Host)(nil)
	_ driver.MountTable   = (*fake.Host)(nil)
	_ driver.LoopDevices  = (*fake.Host)(nil)
	_ driver.BlockDevices = (*fake.Host)(nil)
	_ driver.Filesystems  = (*fake.Host)(nil)
)
