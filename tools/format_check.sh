#!/bin/bash
# Checks that C and C++ files follow .clang-format (Google, 100 columns).
# With no arguments: the files changed since origin/main, or since the
# previous commit where there is no such branch. With arguments: those files.
# Exits 1 and lists the files that differ; `clang-format -i FILE` fixes one.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "format_check: clang-format is not installed (apt-get install clang-format)" >&2
  exit 2
fi
if [[ $# -gt 0 ]]; then
  files=("$@")
else
  base=$(git rev-parse --verify -q origin/main || git rev-parse HEAD~1)
  mapfile -t files < <(git diff --name-only --diff-filter=d "$base" -- '*.cc' '*.h' '*.c')
fi
bad=0
for f in "${files[@]}"; do
  [[ -f "$f" ]] || continue
  if ! clang-format --dry-run -Werror "$f" >/dev/null 2>&1; then
    echo "not formatted: $f"
    bad=1
  fi
done
exit $bad
