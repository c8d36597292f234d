#!/usr/bin/env bash
# The whole test suite: formatting, lint (go vet's analyzers among them), unit
# tests, the CSI sanity suite, end-to-end and fault tests on real loop devices and
# mounts, and the Kubernetes harness. Needs root (mounts, loop devices); run on a
# machine you can spare.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
	echo "hack/test.sh: the suite mounts filesystems and attaches loop devices: run it as root (sudo make test)." >&2
	exit 1
fi
hack/install-deps.sh

# Each phase says when it started, so a slow run shows where its time went.
phase() { printf '== %s  [%dm%02ds]\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }
SECONDS=0

# The Kubernetes harness's components (kube-apiserver, kubelet, the CSI sidecars: 20 min of a
# cold run on 2 cores, beside the rest) build in the background, niced, from the start, using
# whatever the suites before the harness leave idle; warm, they are found in the cache at
# once. The harness phase below waits for them (a test for a tool being built waits on its
# cache entry's lock). docs/deploy.md has a cold run's figures.
prebuild_pid=
prebuild_log=$(mktemp)
stop_prebuild() {
	[ -z "$prebuild_pid" ] || kill -- -"$prebuild_pid" 2>/dev/null || true
	rm -f "$prebuild_log"
}
# test/shared runs beside lint and make unit (below); finish_shared waits for it and prints
# its output, which a failed phase before it also does: its tests detach their loop
# devices in their cleanup, which a kill would skip.
shared_pid=
shared_log=$(mktemp)
unit_skips=$(mktemp)
finish_shared() {
	local rc=0
	wait "$shared_pid" || rc=$?
	shared_pid=
	echo "== shared pools across nodes (test/shared), run beside lint and make unit: exit $rc"
	cat "$shared_log"
	return "$rc"
}
on_exit() {
	if [ -n "$shared_pid" ]; then
		echo "hack/test.sh: waiting for test/shared, beside the failed phase, to end"
		finish_shared || true
	fi
	rm -f "$shared_log" "$unit_skips"
	stop_prebuild
}
trap on_exit EXIT
if [ -f test/k8s/go.mod ]; then
	# setsid: its own process group, so that the trap stops the compilers as well.
	(cd test/k8s && exec setsid nice -n 10 go run ./cmd/prebuild) >"$prebuild_log" 2>&1 &
	prebuild_pid=$!
fi

# The image tests (test/k8s/harness/imageindex_test.go) read the Debian packages pinned in
# deploy/image-packages.lock from .cache/image-debs and never download: fetch them here,
# from deb.debian.org, once (~22 MB; nothing to do when cached).
# A pinned package deb.debian.org no longer serves (a Debian point or security release
# removed it) must not fail every later run: the lock is made anew from the current
# indexes for this run, loudly, and the new lock is for a developer to review and commit.
phase "image packages (make image-debs)"
if ! make --no-print-directory image-debs; then
	echo "deploy/image-packages.lock names packages deb.debian.org no longer serves: pinning the current ones for this run (make image-lock; review and commit deploy/image-packages.lock)"
	make --no-print-directory image-lock
	make --no-print-directory image-debs
fi
phase "gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
	echo "gofmt would change: $unformatted" >&2
	exit 1
fi
# golangci-lint runs go vet's analyzers (its govet linter, .golangci.yml) over the three
# modules: a separate go vet computed the same facts over every dependency again, minutes
# of a cold run.
# The shared-pool suite (test/shared, ~10.5 min alone, mostly waiting on leases, fences
# and a one-node CephFS) runs beside lint and make unit, which are CPU-bound and neither
# mount anything nor run mkfs. Its tests run in a private mount namespace of their own
# (test/support/mountns, from its TestMain): its lost-pool tests leave FUSE mounts whose
# daemon is stopped or killed for seconds, which in the host's mount table would fail
# mkfs.btrfs anywhere on the machine meanwhile ("cannot check mount status ...: Transport
# endpoint is not connected"). Its output is printed when make unit is done, and its
# failure fails the run. It runs at a higher priority (nice -5) than lint and unit: it
# needs little CPU (~100 s in all) but its lease tests need it on time (a node's fence
# must come within its lease's duration of its last renewal; the test allows at most a
# renewal interval more, 0 to 1 s).
phase "golangci-lint (go vet's analyzers included); beside it and make unit, test/shared"
nice -n -5 go test -race ./test/shared -count=1 -timeout 30m >"$shared_log" 2>&1 &
shared_pid=$!
hack/lint.sh
phase "unit tests without root, and internal/driver coverage (make unit)"
# Every test make unit skips for needing root, loop devices or tools is recorded
# (internal/testutil) and runs in the go test phase below; make unit runs the rest.
POOLCSI_UNIT_SKIPS="$unit_skips" hack/unit.sh
phase "shared pools across nodes (test/shared): its end"
shared_rc=0
finish_shared || shared_rc=$?
if [ "$shared_rc" != 0 ]; then
	echo "test/shared: exit $shared_rc" >&2
	exit 1
fi
phase "go test"
# CI=true turns every missing prerequisite into a failure instead of a skip.
# -race everywhere: the root suites drive a separately built binary, so the race
# detector watches the test code and the in-process driver of the unit tests.
# make unit ran the internal/ and cmd/ packages as root too, with -race, and the only
# difference here is POOLCSI_UNIT_ONLY: of them, only the tests it skipped (recorded,
# each top-level test whole) run again. Every other package runs whole.
module=$(go list -m)
skipped_pkgs=()
# (A directory outside $PWD, through a symbolic link, is given as it is: go takes both.)
while read -r dir; do
	case $dir in
	"$PWD"/*) skipped_pkgs+=("./${dir#"$PWD"/}") ;;
	*) skipped_pkgs+=("$dir") ;;
	esac
done < <(cut -f1 "$unit_skips" | sort -u)
skipped_tests=$(cut -f2 "$unit_skips" | sort -u | paste -sd '|')
if [ -n "$skipped_tests" ]; then
	# A name another of these packages also has runs there too: more, never less.
	go test -race "${skipped_pkgs[@]}" -run "^($skipped_tests)\$" -count=1 -timeout 40m
fi
mapfile -t root_pkgs < <(go list ./... | grep -v -e '/test/shared$' -e "^$module/internal/" -e "^$module/cmd/")
go test -race "${root_pkgs[@]}" -count=1 -timeout 40m
if [ -f test/k8s/go.mod ]; then
	# The storage e2e suite (TestE2EStorage, TestE2ETools) is make e2e and make conformance:
	# building e2e.test alone took 16 min of a cold run here, which put make test past an
	# hour. What the suite found is in docs/conformance.md.
	phase "Kubernetes harness (test/k8s), without the storage e2e suite (make e2e, make conformance); beside it the release tools, fuzzing and the legacy client"
	if [ -n "$prebuild_pid" ]; then
		wait "$prebuild_pid" || echo "prebuild failed; the harness builds what is missing:"
		prebuild_pid=
		cat "$prebuild_log"
	fi
	# Beside the harness, which mostly waits on its cluster (31 of a cold run's 75 min, the
	# longest phase): one after another, so that at most one of them competes with it, the
	# release tools (hack/release, a module of their own: TestMakeRelease runs make release
	# into a temp dir, ~6 min), the bounded fuzzing (make fuzz, ~4 min) and the legacy CSI
	# client (test/legacy, spec v1.12.0). Their output is printed when the harness is done.
	beside_log=$(mktemp)
	(
		set -e
		echo "== release tools (hack/release), beside the harness"
		(cd hack/release && go test ./... -count=1 -timeout 30m)
		echo "== fuzzing, bounded (make fuzz), beside the harness"
		hack/fuzz.sh
		echo "== legacy CSI client (test/legacy, spec v1.12.0), beside the harness"
		(cd test/legacy && go test ./... -count=1 -timeout 10m)
	) >"$beside_log" 2>&1 &
	beside_pid=$!
	k8s_rc=0
	# TestUpgradeToCentral (the move of an installed chart from the per-node layout to the
	# central one, a cluster of its own, ~4 min) is not in it either: docs/testing.md.
	(cd test/k8s && go test ./... -count=1 -timeout 80m -skip '^TestE2E|^TestUpgradeToCentral$') || k8s_rc=$?
	beside_rc=0
	wait "$beside_pid" || beside_rc=$?
	cat "$beside_log"
	rm -f "$beside_log"
	if [ "$k8s_rc" != 0 ] || [ "$beside_rc" != 0 ]; then
		echo "test/k8s: exit $k8s_rc; beside it (release tools, fuzzing, legacy client): exit $beside_rc" >&2
		exit 1
	fi
else
	phase "fuzzing, bounded (make fuzz)"
	hack/fuzz.sh
	phase "legacy CSI client (test/legacy, spec v1.12.0)"
	(cd test/legacy && go test ./... -count=1 -timeout 10m)
fi
phase "done"
