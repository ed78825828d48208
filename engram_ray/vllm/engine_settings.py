"""vLLM engine settings a model architecture needs beyond vLLM's defaults, and why.

Everything else runs as vLLM decides (DeepSeek-V4.1: CUDA graphs on, prefix caching as vLLM
chooses for the model). The architecture comes from the model's `config.json`: a local folder,
or the Hugging Face cache for a hub id. A model whose config cannot be read gets the settings
every engram-ray model runs correctly with (eager, no prefix caching), with a warning.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engram_ray.vllm.tiny_checkpoint import ARCHITECTURE as TINY_ARCHITECTURE

logger = logging.getLogger(__name__)

# The tiny model's n-gram history (engram_ray.vllm.ngram_history) holds each token's
# compressed id per KV slot, written by the step that computes that token, in Python on the
# host: a prefix-cache hit skips those steps (the slots would keep another request's ids), and
# a CUDA-graph replay (or torch.compile) runs no Python, so nothing would be written or read.
NGRAM_HISTORY_SETTINGS = {"enforce_eager": True, "enable_prefix_caching": False}
ARCHITECTURE_SETTINGS = {TINY_ARCHITECTURE: NGRAM_HISTORY_SETTINGS}


def model_architectures(model_source: str) -> list[str] | None:
    """`architectures` of the model's config.json, or None where it cannot be read here."""
    path = Path(model_source) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
            cached = try_to_load_from_cache(model_source, "config.json")
        except Exception:  # noqa: BLE001 (not a hub id, no hub client: unknown)
            cached = None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return list(json.loads(path.read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return None


def architecture_engine_kwargs(model_source: str) -> dict:
    """Engine kwargs the model's architecture needs (module doc); {} = vLLM's defaults."""
    architectures = model_architectures(model_source)
    if architectures is None:
        logger.warning("no config.json readable for %s: running it eager without prefix "
                       "caching (what the tiny Engram model needs); make the model folder "
                       "readable where the app is built to get vLLM's defaults", model_source)
        return dict(NGRAM_HISTORY_SETTINGS)
    settings = {}
    for architecture in architectures:
        settings.update(ARCHITECTURE_SETTINGS.get(architecture, {}))
    return settings
