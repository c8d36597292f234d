#!/usr/bin/env bash
# Rewrites the README's list of skipped sanity specs from a real sanity run.
set -euo pipefail
cd "$(dirname "$0")/.."
list=$(hack/sanity-skips.sh)
python3 - "$list" <<'PY'
import re, sys
readme = open("README.md").read()
start, end = "<!-- sanity-skips:start -->", "<!-- sanity-skips:end -->"
block = start + "\n" + sys.argv[1].strip() + "\n" + end
readme = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda m: block, readme, flags=re.S)
open("README.md", "w").write(readme)
PY
