#!/usr/bin/env bash
# streamrl as a user installs it: build a wheel from the checkout, install it into a fresh venv and, from an
# empty folder outside the checkout with an empty STREAMRL_CACHE, run the README's one-minute smoke run from the
# SFT cold start (--init sft). The shipped checkpoint must be found as package data and copied (sha256
# checked), not built. Run by `make test` (CI); takes a few minutes, mostly the installs.
#
# The wheel is built from a copy of the files git would commit (tracked, and untracked ones it does not ignore),
# so neither build/ nor a stale egg-info of the checkout gets in, and nothing is written into the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/streamrl-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir "$work/src" "$work/dist" "$work/empty"

git rev-parse --git-dir >/dev/null 2>&1 || { echo "wheel-smoke: $PWD is not a git checkout" >&2; exit 1; }
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
  tar --null -T - -cf - | tar -xf - -C "$work/src"

"$PY" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check -q)
install=("${pip[@]}" install --no-compile) # a .pyc is written on first import, for what the run imports
"${install[@]}" torch==2.13.0 # pinned first, as scripts/install.sh does: no CUDA build
"${pip[@]}" wheel --no-deps -w "$work/dist" "$work/src"
wheels=("$work"/dist/streamrl-*.whl)
"${install[@]}" "${wheels[0]}"
echo "wheel-smoke: built ${wheels[0]##*/} ($(du -h "${wheels[0]}" | cut -f1)) and installed it into a fresh venv" \
  "in ${SECONDS}s"

cd "$work/empty"
export STREAMRL_CACHE="$work/cache" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
found="$("$work/venv/bin/python" -c 'from importlib import resources; print(resources.files("streamrl.checkpoints"))')" ||
  { echo "wheel-smoke: the installed package has no streamrl.checkpoints" >&2; exit 1; }
shipped="$("$work/venv/bin/python" -c 'from streamrl.sft import SHIPPED; print(SHIPPED)')"
case "$shipped" in
  "$work/venv/"*) ;;
  *) echo "wheel-smoke: the shipped checkpoints resolve to $shipped, not into the installed package" >&2; exit 1 ;;
esac
[ "$shipped" = "$found" ] || { echo "wheel-smoke: SHIPPED=$shipped is not package streamrl.checkpoints ($found)" >&2; exit 1; }
compgen -G "$shipped/*/SHA256SUMS" >/dev/null || {
  echo "wheel-smoke: the installed package has no shipped checkpoint in $shipped (package data missing)" >&2; exit 1; }

# a copy takes seconds; the limit stops a build (hours on one core) early
started=$SECONDS
timeout 600 "$work/venv/bin/streamrl" train --out runs/smoke --init sft --updates 1 --batch 4 --num-envs 4 --tasks 8 \
  --offline-rollouts 1 --eval-episodes 4 --max-new-tokens 16 --no-progress 2>&1 | tee "$work/train.log"

# copied, not built: the log names the shipped copy, and the cache holds exactly its files
line="$(grep -E "^SFT checkpoint [^ ]+: the shipped copy \($shipped/" "$work/train.log")" || {
  echo "wheel-smoke: the run did not copy a shipped SFT checkpoint from $shipped (built it?)" >&2; exit 1; }
name="$(sed -E 's/^SFT checkpoint ([^:]+):.*/\1/' <<<"$line")"
(cd "$STREAMRL_CACHE/sft/$name" && sha256sum --quiet -c "$shipped/$name/SHA256SUMS")
cmp "$STREAMRL_CACHE/sft/$name/streamrl_sft.json" "$shipped/$name/streamrl_sft.json"
grep -q '"update": 1' runs/smoke/metrics.jsonl
echo "wheel-smoke: ok ($name copied from the installed package; the smoke run took $((SECONDS - started))s)"
