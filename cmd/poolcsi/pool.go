package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/poolcsi/poolcsi/internal/pool"
)

const poolUsage = `Usage:
  poolcsi pool unfence --path POOL_DIR --volume VOLUME_ID [--node NODE]

unfence forgets that NODE (every node, without --node) holds the volume, so
another node may publish it. Only for a node that is dead or fenced off: see
docs/fencing.md.
`

// poolCmd runs the operator commands that work on a pool directory directly.
func poolCmd(ctx context.Context, args []string) error {
	if len(args) == 0 || args[0] != "unfence" {
		fmt.Print(poolUsage)
		return errors.New("pool: want a subcommand (unfence)")
	}
	fs := flag.NewFlagSet("pool unfence", flag.ContinueOnError)
	path := fs.String("path", "", "the pool's directory")
	volume := fs.String("volume", "", "the volume ID (<pool>.<32 hex>)")
	node := fs.String("node", "", "the node whose record to drop (default: every node)")
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	id, err := pool.ParseVolumeID(*volume)
	if err != nil {
		return err
	}
	if *path == "" {
		return errors.New("pool unfence: --path is required")
	}
	p, err := pool.Open(pool.Config{Name: id.Pool, Path: filepath.Clean(*path), Shared: true})
	if err != nil {
		return err
	}
	gone, err := p.Unfence(ctx, id, *node)
	if err != nil {
		return err
	}
	if len(gone) == 0 {
		fmt.Printf("volume %s had no publish record to drop\n", id)
		return nil
	}
	fmt.Printf("volume %s: dropped the publish record of %s\n", id, strings.Join(gone, ", "))
	return nil
}
