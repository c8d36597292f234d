package mount

import (
	"bytes"
	"context"
	"crypto/sha256"
	"os"
	"path/filepath"
	"testing"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// TestFence: a fenced loop device maps nothing: while its ext4 is being
// written, the fence makes every write fail, the image is not changed by a
// single byte afterwards (nor grown), the filesystem aborts, and the image
// attaches anew beside the fenced device, whole; a detach of the file takes
// the fenced device away once it is unmounted.
func TestFence(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4")
	if ok, kernel := FenceHolds(); !ok {
		t.Fatalf("kernel %s lets I/O through to a device of size zero: the fence does not hold here", kernel)
	}
	ctx := context.Background()
	l := newLoops(t)
	m := NewMounter()
	img := newImage(t, 64<<20)
	dev := attach(t, l, img)
	if err := Format(ctx, dev, "ext4"); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "mnt")
	mountT(t, m, dev, dir, "ext4", nil)
	write := func(name string) error {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := f.Write(bytes.Repeat([]byte("x"), 1<<20)); err != nil {
			return err
		}
		return f.Sync()
	}
	if err := write("before"); err != nil {
		t.Fatal(err)
	}
	if err := l.Fence(dev); err != nil {
		t.Fatal(err)
	}
	if fenced, err := l.Fenced(dev); err != nil || !fenced {
		t.Fatalf("Fenced: %v %v", fenced, err)
	}
	sum := func() [32]byte {
		b, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		return sha256.Sum256(b)
	}
	at := sum()
	for i := range 5 {
		if err := write("after" + string(rune('0'+i))); err == nil {
			t.Fatalf("write %d through a fenced device succeeded", i)
		}
	}
	if fi, err := os.Stat(img); err != nil || fi.Size() != 64<<20 {
		t.Fatalf("image after the fence: %v %v", fi.Size(), err)
	}
	if sum() != at {
		t.Fatal("the image changed after the fence")
	}
	if size, err := DeviceSize(dev); err != nil || size != 0 {
		t.Fatalf("fenced device size %d, %v", size, err)
	}
	// The image is no longer attached there: a new attach makes a device of
	// its own, which sees the filesystem as it was.
	if got, ok, err := l.Find(img); err != nil || ok {
		t.Fatalf("Find after the fence: %s %v %v", got, ok, err)
	}
	if !l.Backs(dev, img) {
		t.Fatal("the fenced device is not known as the image's")
	}
	if err := m.Unmount(ctx, dir); err != nil {
		t.Fatal(err)
	}
	fresh := attach(t, l, img)
	if fresh == dev {
		t.Fatalf("attached to the fenced device %s again", dev)
	}
	if fs, err := DiskFormat(ctx, fresh); err != nil || fs != "ext4" {
		t.Fatalf("the image seen anew: %q %v", fs, err)
	}
	if err := l.Detach(ctx, img); err != nil {
		t.Fatal(err)
	}
	if fenced, err := l.Fenced(dev); err == nil && fenced {
		t.Fatalf("the fenced device %s is still attached after the file's detach", dev)
	}
	// The fence's read-only flag went with the device: its next user (here,
	// anybody's mount -o loop) gets a writable device.
	if ro, err := os.ReadFile(filepath.Join(sysBlock, filepath.Base(dev), "ro")); err != nil || string(bytes.TrimSpace(ro)) != "0" {
		t.Fatalf("%s after its detach: ro=%q %v; the fence's BLKROSET outlived it", dev, ro, err)
	}
}
