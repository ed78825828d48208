"""vLLM general plugin (entry point group `vllm.general_plugins`), run in every vLLM process.

`register()`:
- requests the AMX tile state on a CPU with AMX (`engram_ray.vllm.cpu_features.request_amx`): vLLM's
  CPU attention uses AMX there, and a worker that never asked Linux for the tile state dies with
  SIGILL at its first forward. The plugin is the one hook that runs in every vLLM process (the
  driver, EngineCore and every worker) before model code; no other process the project starts
  runs AMX code of vLLM's (Ray actors, the CLI and the torch reference use oneDNN, which asks
  for itself);
- in vLLM's engine processes (EngineCore, workers), watches the parent process and ends the
  engine when it is gone (`engram_ray.vllm.orphan_watch`: a killed replica leaves no engine
  holding its GPU memory and ports);
- turns on Python's `faulthandler` (if not on already), so a process killed by a fatal signal
  (SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGABRT) says which signal and where on its stderr, the
  replica's log: vLLM itself logs only an exit code, and not at all for a worker that dies
  before it is ready (`engram_ray.serve.engine_death` reads it back);
- registers `EngramTinyForCausalLM` (engram_ray.vllm.tiny_engram) as a vLLM architecture,
  by name only, so nothing heavy is imported here;
- patches DeepSeek-V4.1's Engram table class (`engram_ray.vllm.deepseek_engram`) in
  `vllm.models.deepseek_v41.common.engram`: at once if vLLM has imported that module already,
  otherwise right after vLLM imports it (importing it takes ~8 s; processes that never serve
  DeepSeek-V4.1 never pay for it). The patch first checks the installed vLLM
  (`engram_ray.vllm.compat`): an unsupported release stops the engine there, with one line.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import importlib.util
import sys

TINY_ARCHITECTURE = "EngramTinyForCausalLM"
TINY_MODEL_CLASS = "engram_ray.vllm.tiny_engram:EngramTinyForCausalLM"
ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"


def _patch(module) -> None:
    from engram_ray.vllm.deepseek_engram import patch_engram_module
    patch_engram_module(module)


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ENGRAM_MODULE through the other finders, runs it, then patches it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ENGRAM_MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _patch(module)


def install_deepseek_patch() -> None:
    """Patch now, or after vLLM imports the DeepSeek-V4.1 Engram module (idempotent)."""
    module = sys.modules.get(ENGRAM_MODULE)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


def register() -> None:
    from engram_ray.vllm.cpu_features import request_amx
    from engram_ray.vllm.orphan_watch import watch_parent

    request_amx()  # first: before vLLM can run an AMX instruction in this process (see above)
    watch_parent()  # an engine process ends with its parent, however that dies
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    from vllm import ModelRegistry

    if TINY_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TINY_ARCHITECTURE, TINY_MODEL_CLASS)
    install_deepseek_patch()
