// Command cephfs-up runs the one-node Ceph cluster of package cephfs for tests
// outside this module (test/k8s, its own module): it starts the cluster, prints
// one JSON line on stdout naming its two ceph-fuse mounts, and tears everything
// down when its standard input closes (its parent is done, or died). Its daemons
// die with it (parent-death signal); a mount a killed run left is removed by the
// next start.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/poolcsi/poolcsi/test/support/cephfs"
)

// Ready is the line printed once the cluster is up.
type Ready struct {
	Dir       string    `json:"dir"`
	Mounts    [2]string `json:"mounts"`
	Bootstrap string    `json:"bootstrap"`
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "cephfs-up:", err)
		os.Exit(1)
	}
}

func run() error {
	c, err := cephfs.Start(context.Background(), cephfs.Options{})
	if err != nil {
		return err
	}
	if err := json.NewEncoder(os.Stdout).Encode(Ready{Dir: c.Dir, Mounts: c.Mounts, Bootstrap: c.Bootstrap.String()}); err != nil {
		return fmt.Errorf("%w (and teardown: %w)", err, c.Stop())
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
	return c.Stop()
}
