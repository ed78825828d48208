#!/usr/bin/env bash
# The README's first command: sets up this machine (scripts/setup.sh), then runs the local
# deployment. Until `engram-ray local` is available it prints the DeepSeek-V4.1-Flash memory plan
# (peer-group split against CPU offload). Extra arguments go to `engram-ray local`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if python3 -c 'import sys; from engram_ray.commands import COMMANDS; sys.exit("local" not in COMMANDS)'; then
    exec engram-ray local "$@"
fi
echo "[local] DeepSeek-V4.1-Flash Engram memory plan (engram-ray plan --compare)"
exec engram-ray plan --compare
