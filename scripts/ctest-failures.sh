#!/usr/bin/env bash
# Prints, for each test the last ctest run in BUILD_DIR failed, the lines of its output that say
# why (Catch2's failed assertions and their expansions and messages, RESULT lines, sanitizer
# headers), a few per test. `make test` calls it when ctest fails, so that the reason is in the
# last lines of a log that is only shown by its tail (CI).
#   scripts/ctest-failures.sh build/asan
set -uo pipefail
dir="${1:?usage: $0 BUILD_DIR}"
failed="$dir/Testing/Temporary/LastTestsFailed.log"
log="$dir/Testing/Temporary/LastTest.log"
[ -f "$failed" ] && [ -f "$log" ] || exit 0
echo
echo "=== why the failed tests failed (from $log) ==="
while IFS= read -r line; do
  name="${line#*:}"
  echo "--- $name"
  # The test's block in LastTest.log runs from its "N/M Test: <name>" line to the next one.
  awk -v name="$name" '
    /^[0-9]+\/[0-9]+ Test: / { inside = (substr($0, index($0, "Test: ") + 6) == name); next }
    inside' "$log" |
    grep -E -A3 'FAILED:|failed:|RESULT: NOT|with message|ERROR: .*Sanitizer|WARNING: ThreadSanitizer|runtime error|Timeout|problem|untouched by any fault|slowest room|^  (1p1d|2p2d):' |
    grep -v '^--$' | cut -c1-400 | head -n 40
done < "$failed"
