"""Write the tiny Engram model: config.json, a locally trained tokenizer, seeded weights.

Weights are stored under the vLLM parameter names of `EngramTinyForCausalLM` (fused
`qkv_proj` and `gate_up_proj`). Engram tables use the DeepSeek-V4.1 checkpoint format:
`model.layers.<id>.engram.embed.weight` FP8 e4m3 `[rows, head_dim]` and
`...weight_scale_inv` ue8m0 (float8_e8m0fnu) `[rows, head_dim // 32]`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engram_ray.errors import ConfigError
from engram_ray.model.hashing import build_token_map
from engram_ray.model.layout import EngramLayout
from engram_ray.vllm.tiny_tokenizer import PAD_TOKEN, hf_tokenizer_config, train_tokenizer

ARCHITECTURE = "EngramTinyForCausalLM"
WEIGHTS_FILE = "model.safetensors"
# ue8m0 exponent bytes around 127 (scale 1): rows stay O(1) after dequantization.
SCALE_BYTES = (125, 130)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny model. Attention head size 64 is one vLLM's CPU attention supports."""

    tokenizer_vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 512
    engram_layer_ids: tuple[int, ...] = (0, 1)
    engram_vocab_size: int = 4000
    engram_max_ngram_size: int = 3
    engram_n_heads: int = 2
    engram_head_dim: int = 64
    # Experts per MLP (vLLM's `MixtralMoE` layer); 0: a dense MLP. vLLM forms a data-parallel
    # group only for MoE models (dense DP ranks run as independent engines), so DP gangs are
    # tried with experts.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("num_experts_per_tok", f"is {self.num_experts_per_tok}",
                              f"between 1 and num_experts ({self.num_experts})")
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ConfigError("hidden_size", f"is {self.hidden_size}",
                              "num_attention_heads * head_dim")
        for layer_id in self.engram_layer_ids:
            if not 0 <= layer_id < self.num_hidden_layers:
                raise ConfigError("engram_layer_ids", f"has {layer_id}",
                                  f"ids in [0, {self.num_hidden_layers})")


def model_config(spec: TinyModelSpec, compressed_vocab_size: int, pad_token_id: int,
                 vocab_size: int) -> dict:
    """config.json: a Llama-shaped config (transformers parses it) plus the Engram fields."""
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": pad_token_id,
        "engram_layer_ids": list(spec.engram_layer_ids),
        "engram_vocab_size": spec.engram_vocab_size,
        "engram_max_ngram_size": spec.engram_max_ngram_size,
        "engram_n_heads": spec.engram_n_heads,
        "engram_head_dim": spec.engram_head_dim,
        "engram_compressed_vocab_size": compressed_vocab_size,
        "engram_pad_token_id": pad_token_id,
        "engram_tiny_spec": asdict(spec),
    }
    if spec.num_experts:  # the key vLLM reads for Mixtral (ModelConfig.is_moe)
        config.update(num_local_experts=spec.num_experts,
                      num_experts_per_tok=spec.num_experts_per_tok)
    config["engram_num_embeddings"] = list(EngramLayout.from_config(config).rows_per_table)
    return config


def _normal(gen, *shape, std):
    return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def engram_table(num_rows: int, head_dim: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(values FP8 e4m3 `[rows, head_dim]`, scales float8_e8m0fnu `[rows, head_dim // 32]`)."""
    values = torch.randn(num_rows, head_dim, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.randint(*SCALE_BYTES, (num_rows, head_dim // 32), generator=gen,
                           dtype=torch.uint8)
    return values, scales.view(torch.float8_e8m0fnu)


def model_weights(spec: TinyModelSpec, config: dict) -> dict[str, torch.Tensor]:
    """Seeded random weights under vLLM parameter names."""
    gen = torch.Generator().manual_seed(spec.seed)
    hidden, inter, vocab = spec.hidden_size, spec.intermediate_size, config["vocab_size"]
    qkv_rows = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim
    layout = EngramLayout.from_config(config)
    weights = {"model.embed_tokens.weight": _normal(gen, vocab, hidden, std=1.0),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "lm_head.weight": _normal(gen, vocab, hidden, std=1 / math.sqrt(hidden))}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{p}.self_attn.qkv_proj.weight": _normal(gen, qkv_rows, hidden,
                                                      std=1 / math.sqrt(hidden)),
            f"{p}.self_attn.o_proj.weight": _normal(gen, hidden, hidden,
                                                    std=1 / math.sqrt(hidden)),
        })
        weights.update(_mlp_weights(gen, spec, f"{p}.mlp"))
    for layer_id, num_rows in zip(layout.layer_ids, layout.rows_per_table):
        p = f"model.layers.{layer_id}.engram"
        values, scales = engram_table(num_rows, layout.head_dim, gen)
        in_features = layout.num_cols * layout.head_dim
        weights.update({
            f"{p}.embed.weight": values,
            f"{p}.embed.weight_scale_inv": scales,
            f"{p}.kv_proj.weight": _normal(gen, 2 * hidden, in_features,
                                           std=2 / math.sqrt(in_features)),
            f"{p}.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    return weights


def _mlp_weights(gen, spec: TinyModelSpec, p: str) -> dict[str, torch.Tensor]:
    """A dense MLP's fused weights, or the router and per-expert weights of `MixtralMoE`
    (checkpoint names `experts.<e>.w1/w2/w3`: gate, down, up)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    if not spec.num_experts:
        return {f"{p}.gate_up_proj.weight": _normal(gen, 2 * inter, hidden,
                                                    std=1 / math.sqrt(hidden)),
                f"{p}.down_proj.weight": _normal(gen, hidden, inter, std=1 / math.sqrt(inter))}
    weights = {f"{p}.gate.weight": _normal(gen, spec.num_experts, hidden,
                                           std=1 / math.sqrt(hidden))}
    for e in range(spec.num_experts):
        weights.update({
            f"{p}.experts.{e}.w1.weight": _normal(gen, inter, hidden, std=1 / math.sqrt(hidden)),
            f"{p}.experts.{e}.w3.weight": _normal(gen, inter, hidden, std=1 / math.sqrt(hidden)),
            f"{p}.experts.{e}.w2.weight": _normal(gen, hidden, inter, std=1 / math.sqrt(inter))})
    return weights


def write_tiny_model(model_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write config.json, tokenizer files and model.safetensors into `model_dir`."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.tokenizer_vocab_size)
    _, compressed_vocab_size = build_token_map(tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = model_config(spec, compressed_vocab_size, tokenizer.token_to_id(PAD_TOKEN),
                          vocab_size)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(hf_tokenizer_config(spec.max_position_embeddings), indent=2) + "\n")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (model_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
    save_file(model_weights(spec, config), str(model_dir / WEIGHTS_FILE),
              metadata={"format": "pt"})
    return model_dir
