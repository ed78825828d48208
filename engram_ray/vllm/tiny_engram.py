"""`EngramTinyForCausalLM`: a small Llama-shaped decoder with Engram layers, built from vLLM's
own layers, hashing with `engram_ray.model.hashing` and reading engram-ray tables.

Engram layer (before decoder layer `layer_id`, on the residual stream h `[T, hidden]`):

    rows  = table lookup of the token's n-gram row ids        bf16 [T, num_cols, head_dim]
    k, v  = split(kv_proj(flatten(rows)))                          [T, hidden] each
    gate  = sigmoid(sum(rms_norm(h) * k) / sqrt(hidden))           [T, 1]
    h    += gate * v

Tables come from `engram_ray.vllm.engram_tables.open_model_tables`: whole in this process,
or this engine's slice of a peer group (`additional_config["engram_peer_group"]`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                 VocabParallelEmbedding)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.sequence import IntermediateTensors

from engram_ray.model.hashing import build_token_map, hash_context
from engram_ray.model.layout import EngramLayout
from engram_ray.vllm.engram_tables import open_model_tables
from engram_ray.vllm.ngram_history import NgramHistory


class TinyEngram(nn.Module):
    """Gated projection of one token's looked-up rows into the residual stream."""

    def __init__(self, hidden_size: int, num_cols: int, head_dim: int, eps: float, prefix: str):
        super().__init__()
        self.hidden_size = hidden_size
        self.kv_proj = ReplicatedLinear(num_cols * head_dim, 2 * hidden_size, bias=False,
                                        prefix=f"{prefix}.kv_proj")
        self.norm = RMSNorm(hidden_size, eps=eps)

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden `[T, hidden]`, rows bf16 `[T, num_cols, head_dim]` -> hidden `[T, hidden]`."""
        kv, _ = self.kv_proj(rows.flatten(1).to(hidden.dtype))
        key, value = kv.chunk(2, dim=-1)
        score = (self.norm(hidden) * key).sum(-1, keepdim=True) / math.sqrt(self.hidden_size)
        return hidden + torch.sigmoid(score) * value


class EngramTinyModel(nn.Module):

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model"):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.layout = EngramLayout.from_config(config.to_dict(), "config.json")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(vllm_config=vllm_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)])
        num_experts = getattr(config, "num_local_experts", 0)
        for i, layer in enumerate(self.layers if num_experts else []):
            # vLLM's own MoE block in place of the dense MLP (same call: hidden -> hidden).
            from vllm.model_executor.models.mixtral import MixtralMoE

            layer.mlp = MixtralMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                   config.intermediate_size, prefix=f"{prefix}.layers.{i}.mlp")
        for layer_id in self.layout.layer_ids:
            # Named like the checkpoint: model.layers.<id>.engram.*
            self.layers[layer_id].engram = TinyEngram(
                config.hidden_size, self.layout.num_cols, self.layout.head_dim,
                config.rms_norm_eps, prefix=f"{prefix}.layers.{layer_id}.engram")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.history = self._make_history(vllm_config)
        self.tables = open_model_tables(self.layout, vllm_config)
        self._attn_layer_name = self.layers[0].self_attn.attn.layer_name

    def _make_history(self, vllm_config: VllmConfig) -> NgramHistory:
        from transformers import AutoTokenizer

        model_config = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        token_map, compressed_vocab_size = build_token_map(tokenizer)
        if compressed_vocab_size != self.layout.compressed_vocab_size:
            raise ValueError(
                f"engram_compressed_vocab_size is {self.layout.compressed_vocab_size} in "
                f"config.json but the tokenizer compresses to {compressed_vocab_size} ids; "
                "every hash multiplier depends on it: regenerate the model with "
                "`engram-ray make-tiny-model`")
        pad_id = int(token_map[self.layout.pad_token_id])
        return NgramHistory(token_map, self.layout.max_ngram_size, pad_id,
                            vllm_config.cache_config.block_size)

    def _attn_metadata(self):
        if not is_forward_context_available():
            return None
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0] if metadata else None
        if isinstance(metadata, dict):
            metadata = metadata.get(self._attn_layer_name)
        return metadata

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        contexts = self.history.contexts(input_ids, positions, self._attn_metadata())
        residual = None
        for layer_id, layer in enumerate(self.layers):
            if hasattr(layer, "engram"):
                if residual is not None:
                    hidden, residual = hidden + residual, None
                row_ids = hash_context(contexts, self.layout, self.layout.layer_idx(layer_id))
                rows = self.tables.lookup(layer_id, row_ids, out="bf16")
                hidden = layer.engram(hidden, rows)
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class EngramTinyForCausalLM(nn.Module):
    """vLLM architecture `EngramTinyForCausalLM` (registered by engram_ray.vllm.plugin)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError("EngramTinyForCausalLM runs with tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1; split its tables with a peer group "
                             "instead (additional_config.engram_peer_group)")
        self.config = config
        self.model = EngramTinyModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names are vLLM parameter names; Engram tables go to `tables`."""
        from vllm.model_executor.models.utils import AutoWeightsLoader

        params = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            if ".engram.embed." in name:
                self.model.tables.load_checkpoint_tensor(name, weight)
                loaded.add(name)
                continue
            if ".mlp.experts." in name or ".mlp.gate." in name:  # MixtralMoE loads its own
                block, _, rest = name.partition(".mlp.")
                mlp = self.get_submodule(f"{block}.mlp")
                loaded |= {f"{block}.mlp.{n}" for n in
                           AutoWeightsLoader(mlp).load_weights([(rest, weight)])}
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in "
                                 "EngramTinyForCausalLM; regenerate the model with "
                                 "`engram-ray make-tiny-model`")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, weight)
            loaded.add(name)
        return loaded
