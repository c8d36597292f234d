#!/usr/bin/env bash
# Runs every Go fuzz target for a bounded time each (FUZZTIME, default 10s).
# The seed corpora (testdata/fuzz/ and the f.Add seeds) also run as plain
# tests in every go test. A crash found here is saved under testdata/fuzz/ of
# its package: commit it with the fix, so it stays a regression test.
set -euo pipefail
cd "$(dirname "$0")/.."
t=${FUZZTIME:-10s}
export POOLCSI_UNIT_ONLY=1
for target in \
	./internal/pool:FuzzParseVolumeID \
	./internal/pool:FuzzLoad \
	./internal/config:FuzzLoad \
	./internal/mount:FuzzCheckOptions \
	./internal/driver:FuzzListTokens; do
	pkg=${target%%:*} name=${target##*:}
	echo "fuzz $pkg $name ($t)"
	go test "$pkg" -run '^$' -fuzz "^$name\$" -fuzztime "$t" 2>&1 | grep -v '^\(I\|E\|W\)[0-9]\{4\} ' | tail -n 3
	[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "fuzz: $name failed" >&2; exit 1; }
done
