#!/usr/bin/env bash
# Run the test suite. pytest exits 5 when it collects no test: that is a failure for us, not success,
# because a suite that silently stopped collecting tests would otherwise pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
.venv/bin/python -m pytest -q -ra --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
