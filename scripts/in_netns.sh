#!/usr/bin/env bash
# Runs a command in a loopback-only network namespace: Ray binds to every address it finds, so
# tests that start Ray or servers see only 127.0.0.1. Falls back to the host namespace, with a
# warning, where unshare is not permitted.
set -euo pipefail
if unshare -n true 2>/dev/null; then
    exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$@"
fi
echo "[netns] warning: unshare -n not permitted; running in the host network namespace" >&2
exec "$@"
