// Package mountns runs a test binary in a private mount namespace of its own, so
// that the mounts its tests make are never in the host's mount table.
//
// test/shared needs it: its lost-pool tests leave FUSE mounts whose daemon is
// stopped or killed for seconds, and while such a mount is in a mount table,
// mkfs.btrfs run from that table fails ("cannot check mount status ...:
// Transport endpoint is not connected"; btrfs-progs stats every entry of
// /proc/self/mounts, see internal/mount/mkfsns). In a namespace of their own the
// mounts cannot fail a mkfs anywhere else on the machine: another test package
// running beside it, make test's other phases, a developer's work. They also go
// with the namespace when the test binary and its children end, even killed.
// Loop devices, processes and the network stay the host's: tests still detach
// their loop devices in t.Cleanup.
package mountns

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strings"
	"syscall"

	"github.com/poolcsi/poolcsi/internal/testutil"
)

// Env is set in the re-executed test binary's environment to the mount
// namespace it was started from, which it checks it left.
const Env = "POOLCSI_TEST_MOUNTNS_PARENT"

// Isolate, called first in TestMain, re-executes the test binary with the same
// arguments in a new mount namespace whose mounts are all private (nothing
// propagates to the host, nor from it), waits for it and exits with its
// status; it returns only in the process that is to run the tests:
//
//   - the re-executed one, once it has checked that its namespace is not its
//     parent's and that none of its mounts is shared;
//   - one that cannot mount anyway (not root, or POOLCSI_UNIT_ONLY set: every
//     test that mounts skips, or fails under CI, saying why).
//
// As root, a namespace that cannot be made fails the run: its tests would
// otherwise mount in the host's table, silently.
func Isolate() {
	if parent, ok := os.LookupEnv(Env); ok {
		if err := check(parent); err != nil {
			fmt.Fprintf(os.Stderr, "mountns: %v\n", err)
			os.Exit(1)
		}
		return
	}
	if os.Geteuid() != 0 || os.Getenv(testutil.UnitOnlyEnv) != "" {
		return
	}
	os.Exit(reexec())
}

func reexec() int {
	ns, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		fmt.Fprintf(os.Stderr, "mountns: %v\n", err)
		return 1
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(os.Stderr, "mountns: %v\n", err)
		return 1
	}
	// The parent death signal is sent when the thread that started the child
	// ends: keep this one.
	runtime.LockOSThread()
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), Env+"="+ns)
	// The child's output goes straight to ours (the same descriptors), as if
	// it were this process's.
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// With CLONE_NEWNS, os/exec also makes every mount of the new
		// namespace private (mount --make-rprivate /) before the exec;
		// check, in the child, verifies it.
		Unshareflags: syscall.CLONE_NEWNS,
		// A killed go test (or test binary) takes the tests with it.
		Pdeathsig: syscall.SIGKILL,
	}
	// The signals go test and a developer send are the tests' to handle:
	// SIGQUIT (go test's timeout) makes the child print its goroutines. One
	// this process was started ignoring (SIGINT in a shell's background job)
	// stays ignored, in the child too.
	sigs := make(chan os.Signal, 4)
	for _, s := range []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT, syscall.SIGHUP} {
		if !signal.Ignored(s) {
			signal.Notify(sigs, s)
		}
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "mountns: cannot start the tests in a private mount namespace: %v\n", err)
		return 1
	}
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	err = cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code >= 0 {
		return code
	}
	fmt.Fprintf(os.Stderr, "mountns: the tests in the private mount namespace: %v\n", err)
	return 1
}

// check verifies that this process's mount namespace is not parent and that no
// mount in it propagates to another namespace.
func check(parent string) error {
	ns, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return err
	}
	if ns == parent {
		return fmt.Errorf("the tests run in the mount namespace they were started from (%s)", ns)
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for s.Scan() {
		// Optional fields (shared:N, master:N, ...) come after the sixth field,
		// up to the "-" separator.
		fields := strings.Fields(s.Text())
		for i := 6; i < len(fields) && fields[i] != "-"; i++ {
			if strings.HasPrefix(fields[i], "shared:") {
				return fmt.Errorf("a mount of the tests' namespace propagates to others: %s", s.Text())
			}
		}
	}
	return s.Err()
}
