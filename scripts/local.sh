#!/usr/bin/env bash
# The README's first command: sets up this machine (scripts/setup.sh), then runs the local
# deployment `engram-ray local` (tiny Engram model, two CPU engines forming one peer group through
# shared memory, OpenAI API on http://127.0.0.1:8000/v1, metrics, until Ctrl-C; --once stops
# after the check). Extra arguments go to `engram-ray local`.
#
# It runs in the host network namespace so that you can reach the endpoint: every server it
# starts listens on 127.0.0.1 and Ray's node address is 127.0.0.1, but Ray's own processes bind
# to all addresses. Tests run the same command inside scripts/in_netns.sh (loopback only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TMPDIR="${TMPDIR:-/tmp}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
exec engram-ray local "$@"
