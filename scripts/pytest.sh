#!/usr/bin/env bash
# Run the test suite. pytest exits 5 when it collects no test: that is a failure for us, not success,
# because a suite that silently stopped collecting tests would otherwise pass.
#
# Tests run in STREAMRL_TEST_WORKERS pytest-xdist processes (default 2: one per core of the CI machine, each
# test on one torch thread), a test file per process (--dist loadfile) so that a file's module- and
# session-scoped fixtures are built once. The processes share STREAMRL_CACHE, whose builds are locked.
# STREAMRL_TEST_WORKERS=0 runs everything in this process (for pdb, or output of one test).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
workers="${STREAMRL_TEST_WORKERS:-2}"
case "$workers" in
  '' | *[!0-9]*) echo "STREAMRL_TEST_WORKERS must be a number of processes >= 0, got '$workers'" >&2; exit 2 ;;
esac
parallel=()
if [ "$workers" -gt 0 ]; then parallel=(-n "$workers" --dist loadfile); fi
.venv/bin/python -m pytest -q -ra --durations=25 "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
