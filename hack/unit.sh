#!/usr/bin/env bash
# The fast inner loop: every test that needs no root (POOLCSI_UNIT_ONLY=1 makes
# the tests that need root, loop devices or mkfs skip, even as root and in CI;
# `make test` runs them), with the race detector, then internal/driver's
# coverage including the CSI sanity suite that runs over the fake kernel, with
# the packages the driver's tests drive (the layouts, the lease keeper and
# fence, the I/O limits, the pool registry, the freezes, the inline volumes): their code moved out of internal/driver and is still
# covered by the same tests.
set -euo pipefail
cd "$(dirname "$0")/.."
export POOLCSI_UNIT_ONLY=1
cov=$(mktemp -d)
trap 'rm -rf "$cov"' EXIT
# The packages moved out of internal/driver are counted in: its tests drive them.
pkgs=(driver layout fence iolimits params poolset freeze ephemeral)
coverpkg=$(printf './internal/%s,' "${pkgs[@]}")
# internal/driver's tests run once, with the race detector and the coverage both: run
# a second time without -race for the coverage alone, they cost a minute of every run
# (and, cold, a build of all their dependencies without -race).
driver=$(go list ./internal/driver)
mapfile -t others < <(go list ./internal/... ./cmd/... | grep -vxF "$driver")
go test -race -count=1 "${others[@]}"
POOLCSI_COVER_DIR="$cov" go test -race -count=1 -coverpkg="${coverpkg%,}" -coverprofile="$cov/unit.out" ./internal/driver
# -race counts atomically; the children's profiles (the sanity suite's) may say either.
{ echo "mode: atomic"; for f in "$cov"/*.out; do tail -n +2 "$f"; done; } >"$cov/all"
echo "coverage without root (internal/driver's unit tests + sanity over fakes):"
for p in "${pkgs[@]}"; do
	{ echo "mode: set"; grep "/internal/$p/" "$cov/all"; } >"$cov/$p.pkg"
	printf '  internal/%-9s %s\n' "$p" "$(go tool cover -func="$cov/$p.pkg" | tail -n 1 | awk '{print $NF}')"
done
printf '  %-18s %s\n' "all" "$(go tool cover -func="$cov/all" | tail -n 1 | awk '{print $NF}')"
