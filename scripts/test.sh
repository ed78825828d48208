#!/usr/bin/env bash
# The README's test command: sets up, then runs the CPU test suite (tests/cpu) in a
# loopback-only network namespace. Extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TMPDIR="$PWD/.tmp/test"
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" HF_HUB_OFFLINE=1 RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
status=0
bash scripts/in_netns.sh python3 -m pytest tests/cpu -p no:cacheprovider --durations=25 "$@" || status=$?
rm -rf "$TMPDIR"
# pytest's 5 means "no tests collected": a test command that ran nothing has failed.
if [ "$status" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$status"
