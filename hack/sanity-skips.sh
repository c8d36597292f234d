#!/usr/bin/env bash
# Lists the sanity specs the suite skips, grouped by the reason csi-test gives,
# as a Markdown list for the README. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
POOLCSI_SANITY_ACCESS=mount go test ./test/sanity -run "^TestSanity$" -count=1 -v -args -ginkgo.v -ginkgo.no-color >"$log" 2>&1 || true
awk '
/^S \[SKIPPED\]/ { getline name; want = 1; next }
want && /^  \[SKIPPED\] [^i]/ { sub(/^  \[SKIPPED\] /, ""); reason = $0; specs[reason] = specs[reason] "\n  - " name; n[reason]++; want = 0 }
END { for (r in n) printf "- **%s** (%d specs):%s\n", r, n[r], specs[r] }
' "$log"
