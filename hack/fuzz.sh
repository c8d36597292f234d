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
	./internal/driver:FuzzListTokens \
	./internal/driver:FuzzShareResolver; do
	pkg=${target%%:*} name=${target##*:}
	echo "fuzz $pkg $name ($t)"
	out=$(mktemp)
	ok=0
	for attempt in 1 2; do
		if go test "$pkg" -run '^$' -fuzz "^$name\$" -fuzztime "$t" >"$out" 2>&1; then
			ok=1
			break
		fi
		# Go's fuzzing engine sometimes ends a run with only "context deadline exceeded"
		# when -fuzztime runs out while a worker is still busy (no crasher written). A
		# real failure always saves its input under testdata/fuzz: only the former is
		# run again, once.
		if [ "$attempt" = 1 ] && grep -q '^    context deadline exceeded$' "$out" &&
			[ -z "$(git status --porcelain -- "$pkg/testdata/fuzz/$name" 2>/dev/null)" ]; then
			echo "fuzz: $name: the engine timed out at the end of -fuzztime without a crasher; running it again" >&2
			continue
		fi
		break
	done
	if [ "$ok" != 1 ]; then
		grep -v '^[IEW][0-9]\{4\} ' "$out" >&2
		rm -f "$out"
		echo "fuzz: $name failed (a crasher is saved under $pkg/testdata/fuzz/$name)" >&2
		exit 1
	fi
	grep -v '^[IEW][0-9]\{4\} ' "$out" | tail -n 3
	rm -f "$out"
done
