package mount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

func TestOnlineResize(t *testing.T) {
	for _, tc := range []struct {
		fs    string
		size  int64
		tools []string
	}{
		{"xfs", 300 << 20, []string{"mkfs.xfs", "xfs_growfs"}},
		{"btrfs", 128 << 20, []string{"mkfs.btrfs", "btrfs"}},
	} {
		t.Run(tc.fs, func(t *testing.T) {
			requireLoops(t, append(tc.tools, "blkid", "blockdev", "mount", "umount")...)
			ctx := context.Background()
			l, m := newLoops(t), NewMounter()
			file := newImage(t, tc.size)
			if err := Format(ctx, file, tc.fs); err != nil {
				t.Fatal(err)
			}
			dev := attach(t, l, file)
			target := filepath.Join(t.TempDir(), "mnt")
			mountT(t, m, dev, target, tc.fs, nil)
			before := fsBytes(t, target)

			truncate(t, file, 2*tc.size)
			if err := l.Refresh(dev); err != nil {
				t.Fatal(err)
			}
			need, err := m.NeedResize(context.Background(), dev, target)
			if err != nil || !need {
				t.Fatalf("NeedResize = %t, %v; want true", need, err)
			}
			if err := m.ResizeFS(ctx, dev, target); err != nil {
				t.Fatal(err)
			}
			if after := fsBytes(t, target); after <= before+tc.size/2 {
				t.Fatalf("fs size %d -> %d after growing the device by %d", before, after, tc.size)
			}
			// Offline growth is ext4 only; xfs/btrfs must say so, not guess.
			if err := m.ResizeFS(ctx, dev, ""); err == nil {
				t.Error("ResizeFS without a mount point succeeded for " + tc.fs)
			}
		})
	}
}

func TestOfflineExt4Resize(t *testing.T) {
	requireLoops(t, "mkfs.ext4", "e2fsck", "resize2fs", "blkid", "mount", "umount")
	ctx := context.Background()
	l, m := newLoops(t), NewMounter()
	file := newImage(t, 32<<20)
	if err := Format(ctx, file, "ext4"); err != nil {
		t.Fatal(err)
	}
	dev := attach(t, l, file)
	target := filepath.Join(t.TempDir(), "mnt")

	mountT(t, m, dev, target, "ext4", nil)
	before := fsBytes(t, target)
	if err := m.ResizeFS(ctx, dev, ""); !errors.Is(err, ErrDeviceBusy) {
		t.Errorf("offline resize of a mounted device: %v, want ErrDeviceBusy", err)
	}
	if err := m.Unmount(ctx, target); err != nil {
		t.Fatal(err)
	}

	truncate(t, file, 96<<20)
	if err := l.Refresh(dev); err != nil {
		t.Fatal(err)
	}
	if err := m.ResizeFS(ctx, dev, target); err != nil { // target is no longer a mount point
		t.Fatal(err)
	}
	mountT(t, m, dev, target, "ext4", nil)
	if after := fsBytes(t, target); after <= before+48<<20 {
		t.Fatalf("ext4 size %d -> %d after offline resize to 96 MiB", before, after)
	}
}

func TestBindReadOnly(t *testing.T) {
	requireLoops(t, "mount", "umount")
	ctx := context.Background()
	m := NewMounter()
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "data"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(t.TempDir(), "pod", "volume")
	t.Cleanup(func() {
		if err := m.Unmount(context.Background(), target); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := m.Bind(ctx, src, target, true, nil); err != nil {
		t.Fatal(err)
	}
	if err := m.Bind(ctx, src, target, true, nil); err != nil {
		t.Fatalf("repeated Bind: %v", err)
	}
	if err := m.Bind(ctx, src, target, false, nil); !errors.Is(err, ErrMountConflict) {
		t.Errorf("rw Bind over ro bind: %v, want ErrMountConflict", err)
	}
	info, ok, err := m.Info(target)
	if err != nil || !ok || !info.ReadOnly {
		t.Fatalf("Info = %+v, %t, %v", info, ok, err)
	}
	err = os.WriteFile(filepath.Join(target, "new"), []byte("y"), 0o644)
	if !errors.Is(err, unix.EROFS) {
		t.Fatalf("write through read-only bind: %v, want EROFS", err)
	}
	if err := m.Unmount(ctx, target); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(src, "data")); err != nil {
		t.Errorf("source data gone after Unmount: %v", err)
	}
}

func TestUnmountKeepsContent(t *testing.T) {
	m := NewMounter()
	dir := filepath.Join(t.TempDir(), "notmounted")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "keep"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmount(context.Background(), dir); err == nil {
		t.Error("Unmount removed or accepted a non-empty unmounted directory")
	}
	if _, err := os.Stat(filepath.Join(dir, "keep")); err != nil {
		t.Fatalf("content deleted: %v", err)
	}
	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmount(context.Background(), empty); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(empty); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("empty unmounted dir not removed: %v", err)
	}
}

func TestBindBlock(t *testing.T) {
	requireLoops(t, "mount", "umount")
	ctx := context.Background()
	l, m := newLoops(t), NewMounter()
	dev := attach(t, l, newImage(t, 12<<20))
	target := filepath.Join(t.TempDir(), "publish", "pvc-1")
	t.Cleanup(func() {
		if err := m.Unmount(context.Background(), target); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if err := m.BindBlock(ctx, dev, target, false); err != nil {
		t.Fatal(err)
	}
	if err := m.BindBlock(ctx, dev, target, false); err != nil {
		t.Fatalf("repeated BindBlock: %v", err)
	}
	if got, err := DeviceSize(target); err != nil || got != 12<<20 {
		t.Fatalf("DeviceSize(target) = %d, %v", got, err)
	}
	if _, ok, err := m.Info(target); err != nil || !ok {
		t.Fatalf("Info(target) = %t, %v", ok, err)
	}
	if err := m.Unmount(ctx, target); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("block target left behind: %v", err)
	}
}

func TestInfoNotMounted(t *testing.T) {
	m := NewMounter()
	dir := t.TempDir()
	for _, p := range []string{dir, filepath.Join(dir, "missing"), dir + "/./"} {
		if info, ok, err := m.Info(p); err != nil || ok {
			t.Errorf("Info(%s) = %+v, %t, %v; want not mounted", p, info, ok, err)
		}
	}
	if info, ok, err := m.Info("/proc/../proc"); err != nil || !ok || info.FSType != "proc" {
		t.Errorf("Info(/proc/../proc) = %+v, %t, %v", info, ok, err)
	}
}

func TestConcurrentAttach(t *testing.T) {
	requireLoops(t)
	l := newLoops(t)
	const n = 8
	files := make([]string, n)
	devs := make([]string, n)
	for i := range files {
		files[i] = newImage(t, 2<<20)
		file := files[i]
		t.Cleanup(func() {
			if err := l.Detach(context.Background(), file); err != nil {
				t.Errorf("cleanup detach: %v", err)
			}
		})
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { devs[i], errs[i] = l.Attach(context.Background(), files[i]) })
	}
	wg.Wait()
	seen := map[string]bool{}
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("Attach %d: %v", i, errs[i])
		}
		if seen[devs[i]] {
			t.Fatalf("device %s handed out twice: %v", devs[i], devs)
		}
		seen[devs[i]] = true
	}
	for i := range n {
		wg.Go(func() { errs[i] = l.Detach(context.Background(), files[i]) })
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Errorf("Detach %d: %v", i, errs[i])
		}
		if _, err := l.Status(devs[i]); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s still attached: %v", devs[i], err)
		}
	}
}

func BenchmarkAttachDetach(b *testing.B) {
	requireLoops(b)
	l := newLoops(b)
	file := newImage(b, 64<<20)
	b.Cleanup(func() { _ = l.Detach(context.Background(), file) })
	ctx := context.Background()
	for b.Loop() {
		if _, err := l.Attach(ctx, file); err != nil {
			b.Fatal(err)
		}
		if err := l.Detach(ctx, file); err != nil {
			b.Fatal(fmt.Errorf("detach: %w", err))
		}
	}
}

func TestSetReadOnlyClearedByAttach(t *testing.T) {
	requireLoops(t)
	l := newLoops(t)
	file := newImage(t, 4<<20)
	dev := attach(t, l, file)
	t.Cleanup(func() { _ = SetReadOnly(dev, false) })
	if err := SetReadOnly(dev, true); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteAt(make([]byte, 4096), 0)
		f.Close()
	}
	if err == nil {
		t.Fatal("write to a read-only device succeeded")
	}
	if err := l.Detach(context.Background(), file); err != nil {
		t.Fatal(err)
	}
	again := attach(t, l, file)
	if ro, err := readSysBool(again, "ro"); err != nil || ro {
		t.Fatalf("fresh attach on %s is read-only=%t (%v)", again, ro, err)
	}
}
