"""The lookup kernel's logic on CPU: every head dim, both outputs, 16- and 32-row tiles,
sorted ids, prefetch, peer slices, run by Triton's interpreter and compared bit for bit with
the torch reference (tests/gpu repeats this on the GPU at full size)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_kernel_under_the_interpreter_matches_the_reference(head_dim, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path))
    script = Path(__file__).with_name("interpreted_lookup.py")
    done = subprocess.run([sys.executable, str(script), str(head_dim), str(head_dim + 7)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"ok head_dim={head_dim}" in done.stdout


def test_prepared_launcher_under_the_interpreter_matches_the_reference(tmp_path):
    """The launcher serving calls (kernels/lookup_launch.py): ids as vLLM hands them (int32, a
    column slice), outputs written in place; tests/gpu repeats it with direct launches."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path))
    script = Path(__file__).with_name("interpreted_lookup.py")
    done = subprocess.run([sys.executable, str(script), "launcher", "11"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ok launcher" in done.stdout
