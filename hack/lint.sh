#!/usr/bin/env bash
# Runs golangci-lint (pinned; built once from the Go module proxy) over the root
# module, test/k8s, test/legacy and hack/release, with .golangci.yml. Zero findings to pass.
set -euo pipefail
cd "$(dirname "$0")/.."
version=v2.15.0
# Cached outside the work tree, per Go version, like the Kubernetes tools: a fresh clone
# (CI's) finds it and never asks the module proxy (go install m@v always does, for the
# module's deprecation, even with the module cached; a proxy that answered 503 failed a
# run after 21 minutes of waiting).
cache="${XDG_CACHE_HOME:-$HOME/.cache}/poolcsi-tools"
bin="$cache/golangci-lint-$version-$(go env GOVERSION)"
if [ ! -x "$bin" ]; then
	echo "lint: building golangci-lint $version (once, into $cache)"
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	# A proxy's transient error (503) gets one more try.
	for attempt in 1 2; do
		if GOBIN="$tmp" go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$version"; then
			break
		fi
		[ "$attempt" = 2 ] && exit 1
		echo "lint: go install failed (attempt $attempt); trying again in 10 s" >&2
		sleep 10
	done
	mkdir -p "$cache"
	mv "$tmp/golangci-lint" "$bin.tmp"
	mv "$bin.tmp" "$bin"
fi
# Another run on the machine (a developer's, another checkout's) holds golangci-lint's
# lock: wait for it instead of failing the run.
"$bin" run --allow-serial-runners ./...
(cd test/k8s && "$bin" run --allow-serial-runners ./...)
(cd test/legacy && "$bin" run --allow-serial-runners ./...)
(cd hack/release && "$bin" run --allow-serial-runners ./...)
