#!/usr/bin/env bash
# The fast inner loop: every test that needs no root (POOLCSI_UNIT_ONLY=1 makes
# the tests that need root, loop devices or mkfs skip, even as root and in CI;
# `make test` runs them), with the race detector, then internal/driver's
# coverage including the CSI sanity suite that runs over the fake kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
export POOLCSI_UNIT_ONLY=1
cov=$(mktemp -d)
trap 'rm -rf "$cov"' EXIT
go test -race -count=1 ./internal/... ./cmd/...
# internal/params is the driver's request parsing, moved out of it: counted in.
POOLCSI_COVER_DIR="$cov" go test -count=1 -coverpkg=./internal/driver,./internal/params -coverprofile="$cov/unit.out" ./internal/driver >/dev/null
{ echo "mode: set"; for f in "$cov"/*.out; do tail -n +2 "$f"; done; } >"$cov/all"
echo "internal/driver and internal/params coverage without root (unit tests + sanity over fakes):"
go tool cover -func="$cov/all" | tail -n 1
