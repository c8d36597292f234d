package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
)

// WriteJSON writes the report as indented JSON, with the runes a terminal
// would act on escaped (EscapeJSON).
func WriteJSON(w io.Writer, r *Report) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return err
	}
	_, err := w.Write(EscapeJSON(b.Bytes()))
	return err
}

// WriteText renders the report for a person: sections of aligned
// "key: value" lines and tables, abnormal volumes marked "!" and last.
func WriteText(out io.Writer, r *Report) error {
	r = printableCopy(r) // every string in it is the driver's, or holds the driver's
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	p := r.Plugin
	fmt.Fprintf(w, "Plugin %s %s at %s\n", p.Name, p.Version, r.Endpoint)
	probe := "ready"
	switch {
	case p.ProbeError != "":
		probe = "! failed: " + p.ProbeError
	case !p.Ready:
		probe = "! not ready"
	}
	fmt.Fprintf(w, "  probe:\t%s\n", probe)
	fmt.Fprintf(w, "  services:\t%s\n", strings.Join(p.Services, ", "))
	fmt.Fprintf(w, "  capabilities:\t%s\n", OrDash(strings.Join(p.Capabilities, ", ")))

	n := r.Node
	fmt.Fprintln(w, "\nNode")
	if n.NotServed != "" {
		fmt.Fprintf(w, "  %s\n", n.NotServed)
	} else {
		fmt.Fprintf(w, "  node ID:\t%s\n", OrDash(n.NodeID))
		fmt.Fprintf(w, "  max volumes:\t%s\n", maxVolumes(n.MaxVolumes))
		fmt.Fprintf(w, "  topology:\t%s\n", OrDash(segments(n.Topology)))
		fmt.Fprintf(w, "  capabilities:\t%s\n", OrDash(strings.Join(n.Capabilities, ", ")))
		fmt.Fprintf(w, "  storage health:\t%s\n", storageHealth(n))
		fmt.Fprintf(w, "  volume health:\t%s\n", n.VolumeHealthNote)
	}

	c := r.Controller
	fmt.Fprintln(w, "\nController")
	if c.NotServed != "" {
		fmt.Fprintf(w, "  %s\n", c.NotServed)
	} else {
		fmt.Fprintf(w, "  capabilities:\t%s\n", OrDash(strings.Join(c.Capabilities, ", ")))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if c.NotServed == "" {
		writePools(w, c)
		writeVolumes(w, c)
	}
	if len(r.Problems) > 0 {
		fmt.Fprintf(w, "\nProblems (%d)\n", len(r.Problems))
		for _, pr := range r.Problems {
			fmt.Fprintf(w, "  ! %s\n", pr)
		}
	}
	fmt.Fprintf(w, "\n%s\n", summaryLine(r))
	return w.Flush()
}

func writePools(w *tabwriter.Writer, c Controller) {
	fmt.Fprintln(w, "\nPools (GetCapacity)")
	if len(c.Pools) > 0 {
		fmt.Fprintln(w, "  POOL\tAVAILABLE\tLARGEST NEW VOLUME\tSMALLEST")
	}
	for _, pc := range c.Pools {
		name := pc.Pool
		if name == "" {
			name = "(the only pool)"
		}
		if pc.Error != "" {
			fmt.Fprintf(w, "! %s\t?\t?\t?\n", name)
			continue
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\n", name, HumanBytes(pc.AvailableBytes), optBytes(pc.MaximumVolumeBytes), optBytes(pc.MinimumVolumeBytes))
	}
	if c.PoolsNote != "" {
		fmt.Fprintf(w, "  %s\n", c.PoolsNote)
	}
	_ = w.Flush()
}

func writeVolumes(w *tabwriter.Writer, c Controller) {
	fmt.Fprintf(w, "\nVolumes (ListVolumes): %d\n", len(c.Volumes))
	if len(c.Volumes) > 0 {
		fmt.Fprintln(w, "  VOLUME\tPOOL\tLAYOUT\tSIZE\tACCESSIBLE FROM\tPUBLISHED TO\tCONTEXT\tHEALTH")
	}
	for _, v := range c.Volumes {
		mark := " "
		if v.Abnormal {
			mark = "!"
		}
		size := HumanBytes(v.CapacityBytes)
		if v.CapacityBytes == 0 {
			size = "?" // 0 is unknown in CSI
		}
		fmt.Fprintf(w, "%s %s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", mark, v.ID, OrDash(v.Context["pool"]), OrDash(v.Context["layout"]),
			size, accessibleFrom(v), OrDash(strings.Join(v.Published, ",")), OrDash(otherContext(v.Context)), volumeHealth(v))
	}
	if c.VolumesNote != "" {
		fmt.Fprintf(w, "  %s\n", c.VolumesNote)
	}
	_ = w.Flush()
}

func maxVolumes(n int64) string {
	if n <= 0 {
		return "no limit"
	}
	return fmt.Sprint(n)
}

func optBytes(n *int64) string {
	if n == nil {
		return "-"
	}
	return HumanBytes(*n)
}

// segments is a topology as k=v pairs, by key.
func segments(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, ",")
}

// accessibleFrom is where a volume can be used: poolcsi's node topology as
// the node's name, any other as k=v; none is every node.
func accessibleFrom(v Volume) string {
	if v.Unlisted {
		return "?"
	}
	var parts []string
	for _, t := range v.Topology {
		if node, ok := t["topology.poolcsi.io/node"]; ok && len(t) == 1 {
			parts = append(parts, node)
		} else {
			parts = append(parts, segments(t))
		}
	}
	if len(parts) == 0 {
		return "any node"
	}
	return strings.Join(parts, " or ")
}

// otherContext is the volume context but for pool and layout, which have
// their own columns.
func otherContext(m map[string]string) string {
	rest := map[string]string{}
	for k, v := range m {
		if k != "pool" && k != "layout" {
			rest[k] = v
		}
	}
	return strings.ReplaceAll(segments(rest), ",", " ")
}

func volumeHealth(v Volume) string {
	if !v.Abnormal {
		return "ok"
	}
	var reasons []string
	for _, h := range v.Health {
		if !slices.Contains(reasons, h.Reason) {
			reasons = append(reasons, h.Reason)
		}
	}
	if len(reasons) == 0 {
		return "ABNORMAL"
	}
	return "ABNORMAL: " + strings.Join(reasons, ", ")
}

func storageHealth(n Node) string {
	switch {
	case n.StorageHealthNote != "":
		return n.StorageHealthNote
	case len(n.StorageHealth) == 0:
		return "healthy (NodeGetStorageHealth)"
	}
	var parts []string
	for _, h := range n.StorageHealth {
		parts = append(parts, h.Status+" "+h.Reason)
	}
	return "! " + strings.Join(parts, ", ")
}

// summaryLine is the last line: counts a script can read at a glance.
func summaryLine(r *Report) string {
	s := r.Summary
	var b strings.Builder
	if r.Controller.NotServed != "" {
		b.WriteString("no volumes or capacity on this socket (no Controller service)")
	} else {
		fmt.Fprintf(&b, "%s (%s), %d abnormal", count(s.Volumes, "volume"), HumanBytes(s.ProvisionedBytes), s.Abnormal)
		// Each pool's own: pools often share a filesystem, a sum would count its space twice.
		var free []string
		for _, pc := range r.Controller.Pools {
			if pc.Error == "" {
				free = append(free, strings.TrimSpace(pc.Pool+" "+HumanBytes(pc.AvailableBytes)))
			}
		}
		if len(free) == 0 {
			b.WriteString("; capacity unknown")
		} else {
			b.WriteString("; available: " + strings.Join(free, ", "))
		}
	}
	if s.Problems == 0 {
		b.WriteString("; no problems")
	} else {
		b.WriteString("; " + count(s.Problems, "problem"))
	}
	return b.String()
}

// count is n things, in the plural unless one.
func count(n int, thing string) string {
	if n == 1 {
		return "1 " + thing
	}
	return fmt.Sprintf("%d %ss", n, thing)
}

// HumanBytes is n in binary units, as `df -h` and kubectl's Mi/Gi count:
// whole numbers stay whole (a 10 GiB volume is "10 GiB"), others get one decimal.
func HumanBytes(n int64) string {
	const unit = 1024
	if n < unit && n > -unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit || m <= -unit; m /= unit {
		div *= unit
		exp++
	}
	if n%div == 0 {
		return fmt.Sprintf("%d %ciB", n/div, "KMGTPE"[exp])
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// OrDash is s, or "-" for nothing, in a table cell.
func OrDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
