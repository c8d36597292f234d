package cluster

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/poolcsi/poolcsi/hack/release/chart"
)

// TestImageToolsMatchDockerfile keeps deploy/Dockerfile and the tests' image builder on one
// list: every package of deploy/image-tools.txt is installed by the Dockerfile, and, on a
// Debian machine, each listed file really belongs to the package named beside it (so the
// image built here from this machine's packages has what the Dockerfile's image has).
func TestImageToolsMatchDockerfile(t *testing.T) {
	tools, err := ImageTools()
	if err != nil {
		t.Fatal(err)
	}
	if len(tools) == 0 {
		t.Fatal("deploy/image-tools.txt lists nothing")
	}
	df, err := os.ReadFile(filepath.Join(chart.RepoRoot(), "deploy", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	install := regexp.MustCompile(`apt-get install[^&]*`).FindString(strings.ReplaceAll(string(df), "\\\n", " "))
	if install == "" {
		t.Fatal("deploy/Dockerfile has no apt-get install")
	}
	installed := map[string]bool{}
	for _, w := range strings.Fields(install) {
		installed[w] = true
	}
	for _, tl := range tools {
		if !installed[tl.Package] {
			t.Errorf("%s comes from %s, which deploy/Dockerfile does not install", tl.Path, tl.Package)
		}
	}
	// The driver runs each of these (itself or through k8s.io/mount-utils).
	listed := map[string]bool{}
	for _, tl := range tools {
		listed[filepath.Base(tl.Path)] = true
	}
	for _, cmd := range []string{"mount", "umount", "blkid", "blockdev", "fsck", "mkfs.ext4", "fsck.ext4", "e2fsck", "resize2fs", "dumpe2fs",
		"mkfs.xfs", "xfs_growfs", "xfs_io", "mkfs.btrfs", "btrfs", "cp"} {
		if !listed[cmd] {
			t.Errorf("deploy/image-tools.txt does not list %s, which poolcsi runs", cmd)
		}
	}
	if _, err := exec.LookPath("dpkg"); err != nil {
		t.Log("not a Debian machine: package ownership not checked")
		return
	}
	for _, tl := range tools {
		owner := dpkgOwner(tl.Path)
		if owner == "" {
			// Merged /usr: dpkg knows /sbin/blkid, not /usr/sbin/blkid.
			owner = dpkgOwner(strings.TrimPrefix(tl.Path, "/usr"))
		}
		switch {
		case owner == "":
			Missing(t, tl.Path+" is not installed from a Debian package here (hack/install-deps.sh installs "+tl.Package+")")
		case owner != tl.Package:
			t.Errorf("%s belongs to %s here, deploy/image-tools.txt says %s", tl.Path, owner, tl.Package)
		}
	}
}

func dpkgOwner(p string) string {
	out, err := exec.Command("dpkg", "-S", p).Output()
	if err != nil {
		return ""
	}
	line := strings.SplitN(strings.TrimSpace(string(out)), "\n", 2)[0]
	pkg := strings.SplitN(line, ":", 2)[0]
	return strings.TrimSpace(pkg)
}

// WithHostBinaries puts the machine's binary, and the libraries it loads, where an image
// had a busybox applet.
func TestWithHostBinaries(t *testing.T) {
	if !FileExists("/usr/bin/dd") {
		Missing(t, "needs /usr/bin/dd (Debian package coreutils)")
	}
	img := Image{Ref: "x", Files: []ImageFile{
		{Path: "/usr/bin/busybox", Src: "/bin/busybox"},
		{Path: "/usr/bin/dd", Link: "/usr/bin/busybox"},
	}}
	got := WithHostBinaries(t, img, "/usr/bin/dd")
	var dd []ImageFile
	libc := false
	for _, f := range got.Files {
		if f.Path == "/usr/bin/dd" {
			dd = append(dd, f)
		}
		if strings.Contains(f.Path, "/libc.so") {
			libc = true
		}
	}
	if len(dd) != 1 || dd[0].Src != "/usr/bin/dd" || dd[0].Link != "" {
		t.Errorf("/usr/bin/dd in the image = %+v, want the host's binary once", dd)
	}
	if !libc {
		t.Errorf("the image lacks the C library dd loads: %+v", got.Files)
	}
	if len(img.Files) != 2 || img.Files[1].Link == "" {
		t.Error("WithHostBinaries changed the image it was given")
	}
}

// The poolcsi image holds every tool of deploy/image-tools.txt, once each.
func TestPoolcsiImageFiles(t *testing.T) {
	tools, err := ImageTools()
	if err != nil {
		t.Fatal(err)
	}
	img := PoolcsiImage(t, "x", "/bin/true")
	count := map[string]int{}
	for _, f := range img.Files {
		count[f.Path]++
	}
	for p, n := range count {
		if n > 1 {
			t.Errorf("%s is in the image %d times", p, n)
		}
	}
	for _, tl := range tools {
		if count[usrPath(tl.Path)] != 1 {
			t.Errorf("%s (%s) is not in the image", tl.Path, tl.Package)
		}
	}
}
