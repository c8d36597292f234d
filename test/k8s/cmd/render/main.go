// Command render regenerates deploy/kubernetes/poolcsi.yaml from the Helm chart.
package main

import (
	"fmt"
	"os"

	"github.com/poolcsi/poolcsi/hack/release/chart"
)

func main() {
	if err := chart.WriteRepo(); err != nil {
		fmt.Fprintln(os.Stderr, "render:", err)
		os.Exit(1)
	}
	fmt.Println("wrote", chart.RenderedFile())
}
