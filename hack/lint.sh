#!/usr/bin/env bash
# Runs golangci-lint (pinned; built once from the Go module proxy into bin/)
# over the root module and test/k8s, with .golangci.yml. Zero findings to pass.
set -euo pipefail
cd "$(dirname "$0")/.."
version=v2.15.0
bin="$PWD/bin/golangci-lint-$version"
if [ ! -x "$bin" ]; then
	echo "lint: building golangci-lint $version (once)"
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	GOBIN="$tmp" go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$version"
	mkdir -p bin
	mv "$tmp/golangci-lint" "$bin"
fi
"$bin" run ./...
(cd test/k8s && "$bin" run ./...)
(cd test/legacy && "$bin" run ./...)
