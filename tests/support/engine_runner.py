"""Test support: a vLLM engine with engram-ray's plugin outside Ray Serve (the CPU tests of the
tiny model, the AMX guard, KV-cache capacity). Serve builds its engines' arguments itself
(`engram_ray.serve.settings.engine_args.engine_kwargs`); both take the architecture's settings from
`engram_ray.vllm.engine_settings`.

    args = build_engine_args(model_dir, peer_group={"size": 2, "store_dir": DIR, "rank": 0,
                                                    "generation": "g1"})
    engine = EngramEngine(model_dir, peer_group=...)      # sync, wraps vllm.LLM
    engine.generate(["The river"], max_tokens=16)          # -> [[token ids]] (greedy)
    engine.metrics()                                       # -> {"vllm:kv_cache_usage_perc": ..}
    engine = await start_async_engine(model_dir, ...)       # vllm AsyncLLM, same settings

The plugin (entry point `vllm.general_plugins`) loads in every vLLM process by itself; the
peer-group settings travel in `additional_config["engram_peer_group"]`. Every engine of a
group must be started together: each blocks in its table rendezvous until all have arrived.
"""

from __future__ import annotations

import os
from typing import Any

from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.vllm.engine_settings import architecture_engine_kwargs

CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def _settings(peer_group) -> PeerGroupSettings | None:
    if peer_group is None or isinstance(peer_group, PeerGroupSettings):
        return peer_group
    return PeerGroupSettings.from_additional_config({"engram_peer_group": dict(peer_group)})


def build_engine_args(model_dir: str, peer_group: dict | PeerGroupSettings | None = None, *,
                      max_model_len: int = 256, max_num_seqs: int = 8, seed: int = 0,
                      **overrides: Any) -> dict:
    """Keyword arguments for `vllm.LLM(...)` / `vllm.AsyncEngineArgs(...)`.

    What the architecture needs (the tiny model: eager mode, no prefix caching, its n-gram
    history is keyed by KV slot), TP = PP = 1, stats on (for metrics). `overrides` win.
    """
    settings = _settings(peer_group)
    args = dict(model=str(model_dir), tokenizer=str(model_dir), max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, seed=seed,
                **architecture_engine_kwargs(str(model_dir)), tensor_parallel_size=1,
                pipeline_parallel_size=1, disable_log_stats=False,
                additional_config=settings.to_additional_config() if settings else {})
    args.update(overrides)
    return args


def apply_cpu_defaults() -> None:
    """Environment vLLM on CPU needs (KV cache size in GiB, offline hub); keeps what is set."""
    for key, value in CPU_DEFAULTS.items():
        os.environ.setdefault(key, value)


def greedy_params(max_tokens: int):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def metric_values() -> dict[str, float]:
    """This process's vLLM gauges and counters (summed over labels) by name."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    values: dict[str, float] = {}
    for metric in get_metrics_snapshot():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            values[metric.name] = values.get(metric.name, 0.0) + float(value)
    return values


class EngramEngine:
    """A synchronous vLLM engine (`vllm.LLM`) serving an Engram model."""

    def __init__(self, model_dir: str, peer_group: dict | PeerGroupSettings | None = None,
                 **options: Any):
        from vllm import LLM

        self.llm = LLM(**build_engine_args(model_dir, peer_group, **options))

    def generate(self, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
        """Greedy completions (EOS ignored, so every completion has max_tokens tokens)."""
        outputs = self.llm.generate(prompts, greedy_params(max_tokens), use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    def metrics(self) -> dict[str, float]:
        """vLLM's gauges and counters by name (e.g. `vllm:kv_cache_usage_perc`)."""
        return metric_values()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()


async def start_async_engine(model_dir: str, peer_group=None, **options: Any):
    """`vllm.v1.engine.async_llm.AsyncLLM` with the same settings (for Ray Serve)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(**build_engine_args(model_dir, peer_group, **options))
    return AsyncLLM.from_engine_args(engine_args)


async def generate_async(engine, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    """Greedy completions from an AsyncLLM, all prompts in flight at once."""
    import asyncio
    import uuid

    params = greedy_params(max_tokens)

    async def one(prompt: str) -> list[int]:
        final = None
        async for output in engine.generate(prompt, params, f"engram-{uuid.uuid4().hex}"):
            final = output
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))


def _run_async(model_dir, peer_group, prompts, max_tokens, options) -> dict:
    import asyncio

    async def main():
        engine = await start_async_engine(model_dir, peer_group, **options)
        try:
            completions = await generate_async(engine, prompts, max_tokens)
            return {"completions": completions, "metrics": metric_values()}
        finally:
            engine.shutdown()

    return asyncio.run(main())


def run_engine_process(model_dir: str, peer_group: dict | None, prompts: list[str],
                       max_tokens: int, result_path: str, options: dict | None = None,
                       use_async: bool = False) -> None:
    """Process entry (multiprocessing spawn / subprocess): start an engine (`EngramEngine`,
    or AsyncLLM if `use_async`), answer `prompts`, write JSON {"completions", "metrics"} to
    `result_path`. `options`: engine overrides."""
    import json

    apply_cpu_defaults()
    if use_async:
        result = _run_async(model_dir, peer_group, prompts, max_tokens, options or {})
    else:
        engine = EngramEngine(model_dir, peer_group, **(options or {}))
        try:
            result = {"completions": engine.generate(prompts, max_tokens),
                      "metrics": engine.metrics()}
        finally:
            engine.close()
    with open(result_path, "w") as f:
        json.dump(result, f)
