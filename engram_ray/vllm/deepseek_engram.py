"""DeepSeek-V4.1's Engram table on an engram-ray peer group (vLLM 0.33 and 0.34 GPU clusters;
the releases and what this patch assumes about them: `engram_ray.vllm.compat`).

`patch_engram_module(module)` replaces `module.ParallelEngramEmbedding` (vLLM's
`vllm.models.deepseek_v41.common.engram`) with a subclass built from the real class.
`Engram._create_embedding` looks the name up at call time, so every table built afterwards is
ours. The subclass keeps the constructor contract
`(num_embeddings, dim, head_sizes, block_size=32, cpu_offload=False, dp_shared_memory=False,
use_thp=False)` and:

- without `additional_config["engram_peer_group"]`, is vLLM's class; with
  `additional_config["engram_ray_lookup"] = true` a single-shard table (TP = 1, no DP split,
  no DP-shared host memory) is stored packed (`[rows, row_bytes]`, HBM or pinned/THP host) and
  looked up with engram-ray's kernel and tile policy instead of vLLM's;
- with one, stores this engine's row slice of the table (`engram_ray.tables.table.EngramTable`,
  `rows_per_rank = ceil(rows / P)`), exposes it as the `weight` / `weight_scale_inv`
  parameters (strided views of the packed slice) so vLLM's own loader narrows the checkpoint
  to this rank's rows, joins the group once every table of the engine is loaded (the
  `process_weights_after_loading` hook), and looks up with engram-ray's kernel reading peers'
  rows in place. An engine restarted inside its Serve replica maps every member's slices from
  their holders instead (`engram_ray.tables.holding`): its tables are joined before vLLM
  loads weights, and the loader copies no table rows. vLLM's DP split of the table is off
  (`dp_size = 1`: each engine hashes and looks up its own tokens, the model then skips its
  DP gathers), so engines of several DEP deployments can form one group: DP rank d of a
  deployment is member `rank + d`.

Refused with a peer group: architectures other than DeepseekV41ForCausalLM (Qwen4Exp is
excluded for now), tensor or pipeline parallel size > 1, `cpu_offload=true`, a cross-node
group without FABRIC handles.
"""

from __future__ import annotations

import torch
from torch import nn

from engram_ray.errors import ConfigError
from engram_ray.model.layout import EngramLayout
from engram_ray.tables.settings import FIELD as _FIELD
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.tables.table import EngramTables

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
PACKED_LOOKUP_KEY = "engram_ray_lookup"
SUPPORTED_ARCHITECTURES = ("DeepseekV41ForCausalLM",)


def check_peer_group_supported(vllm_config, cpu_offload: bool) -> None:
    """Raise ConfigError for a deployment a peer group cannot serve (see module doc)."""
    architectures = list(getattr(vllm_config.model_config.hf_config, "architectures", None)
                         or [vllm_config.model_config.architecture])
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        raise ConfigError("model architecture", f"is {architectures} with {_FIELD}",
                          f"one of {list(SUPPORTED_ARCHITECTURES)} (Qwen4Exp is excluded for "
                          "now); drop engram_peer_group for this model")
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(parallel, name) > 1:
            raise ConfigError(name, f"is {getattr(parallel, name)} with {_FIELD}",
                              "1: a peer group splits tables over engines instead; scale out "
                              "with data parallelism (DEP) or more engines")
    if cpu_offload:
        raise ConfigError("engram_config.cpu_offload", f"is true together with {_FIELD}",
                          "cpu_offload=false: peer-group slices live in HBM (set "
                          "--engram-config '{\"cpu_offload\": false}')")


_MEMBERS: dict[tuple, EngramTables] = {}


def member_tables(vllm_config, settings: PeerGroupSettings) -> EngramTables:
    """This engine's `engram_ray.tables.table.EngramTables` of its peer group, one per
    (store, generation, rank) in this process: each table's slice is allocated as vLLM builds
    its module (`add_table`), the group is joined once every table is loaded (`mark_loaded`).
    With the Serve app's model-process metrics endpoint, lookups are timed and counted (the
    dashboards' lookup panels have data for DeepSeek-V4.1 too)."""
    key = (settings.store_dir, settings.generation, settings.rank)
    if key not in _MEMBERS:
        from engram_ray.metrics.exposition import start_process_metrics

        config = vllm_config.model_config.hf_text_config.to_dict()
        layout = EngramLayout.from_config(config, "model config")
        device = ("cpu" if settings.backend == "shm"
                  else f"cuda:{torch.cuda.current_device()}")
        _MEMBERS[key] = EngramTables.member(
            layout, settings, device, start_process_metrics(vllm_config.additional_config))
    return _MEMBERS[key]


def close_members() -> None:
    """Release every peer-group member of this process (own slices, peers' mappings)."""
    while _MEMBERS:
        _, tables = _MEMBERS.popitem()
        tables.close()
        if tables.metrics is not None:
            tables.metrics.server.stop()


def _join_hook_class():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class JoinGroupAfterLoading(QuantizeMethodBase):
        """Runs in vLLM's `process_weights_after_loading`, after this table's rows are in."""

        requires_device_loading = False

        def create_weights(self, *args, **kwargs):
            raise NotImplementedError("Engram peer tables allocate their own storage")

        def apply(self, *args, **kwargs):
            raise NotImplementedError("Engram peer tables are looked up, not applied")

        def process_weights_after_loading(self, layer: nn.Module) -> None:
            layer.peer_tables.mark_loaded(layer.layer_id)

    return JoinGroupAfterLoading


def _keep_reattached_rows(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """vLLM's weight loading of a table whose rows were re-attached from the slice holders:
    nothing is copied (peers read that memory; the shm backend maps it read-only), only the
    shape is checked."""
    rows = loaded_weight.shape[0]
    start = getattr(param, "engram_vocab_start", 0)
    if rows < start + param.shape[0] or tuple(loaded_weight.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"checkpoint table {tuple(loaded_weight.shape)} does not hold rows "
                         f"[{start}, {start + param.shape[0]}) of shape {tuple(param.shape)}")


def make_peer_embedding_class(base: type) -> type:
    """Subclass of vLLM's `ParallelEngramEmbedding` (see module doc)."""
    # Long because it is a class body: vLLM's base class is known only at patch time, so the
    # subclass is defined here; its methods are short.
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.utils import set_weight_attrs

    join_hook = _join_hook_class()

    class EngramRayEmbedding(base):
        """vLLM's Engram table, or this engine's slice of an engram-ray peer group."""

        engram_ray_patched = True
        is_peer_table = False
        _packed_table: torch.Tensor | None = None
        _rows = None  # the table's engram_ray.tables.lookup.TableLookup, once bound

        def __init__(self, num_embeddings: int, dim: int, head_sizes: tuple[int, ...],
                     block_size: int = 32, cpu_offload: bool = False,
                     dp_shared_memory: bool = False, use_thp: bool = False) -> None:
            vllm_config = get_current_vllm_config()
            settings = PeerGroupSettings.for_engine(vllm_config)
            self.is_peer_table = settings is not None
            if settings is None:
                self._wants_packed = bool((vllm_config.additional_config or {}).get(
                    PACKED_LOOKUP_KEY, False))
                super().__init__(num_embeddings, dim, head_sizes, block_size, cpu_offload,
                                 dp_shared_memory, use_thp)
                return
            check_peer_group_supported(vllm_config, cpu_offload)
            nn.Module.__init__(self)
            self._init_peer(vllm_config, settings, num_embeddings, dim, tuple(head_sizes),
                            block_size)

        def _init_peer(self, vllm_config, settings, num_embeddings, dim, head_sizes,
                       block_size) -> None:
            self.cpu_offload = self.dp_shared_memory = self.use_thp = False
            self.dp_size = self.tp_size = 1  # vLLM's DP/TP split of this table is off
            self.num_embeddings, self.dim, self.block_size = num_embeddings, dim, block_size
            self.n_hash_cols = self.part_n_hash_cols = len(head_sizes)
            self.head_start, self.vocab_start_idx = 0, 0
            self.vocab_end_idx = sum(head_sizes)
            self._views = self._view_src = None
            tables = member_tables(vllm_config, settings)
            layer_id = tables.layer_of(num_embeddings, head_sizes)
            reattached = tables.reattach_seconds is not None  # its engine restarted
            table = tables.tables[layer_id] if reattached else tables.add_table(layer_id)
            object.__setattr__(self, "peer_tables", tables)  # shared, not a submodule
            self.layer_id = table.layer_id
            self.peer_rows = table.rows_per_rank
            self.part_num_embeddings = table.num_owned_rows
            owned = table.local[:table.num_owned_rows]
            # Strided views into the packed slice: vLLM's loader writes rows in place.
            self.weight = nn.Parameter(owned[:, :dim].view(torch.float8_e4m3fn),
                                       requires_grad=False)
            self.weight_scale_inv = nn.Parameter(owned[:, dim:], requires_grad=False)
            loader = _keep_reattached_rows if reattached else base._weight_loader
            for param in (self.weight, self.weight_scale_inv):
                set_weight_attrs(param, {"weight_loader": loader,
                                         "engram_vocab_start": table.slice_start})
            self.quant_method = join_hook()

        def _allocate_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
            """Called by vLLM's constructor: packed storage for engram-ray's kernel (opt-in,
            single-shard tables only), else vLLM's own."""
            if not (getattr(self, "_wants_packed", False) and self.tp_size == 1
                    and self.dp_size == 1 and not self.dp_shared_memory
                    and not self.peer_rows and self.block_size == 32
                    and torch.get_default_device().type != "meta"):
                return super()._allocate_weights()
            rows, dim = self.part_num_embeddings, self.dim
            row_bytes = dim + dim // self.block_size
            if self.cpu_offload:
                from engram_ray.tables.backends.host_memory import allocate_host_table
                packed = allocate_host_table(rows * row_bytes, use_thp=self.use_thp)
                packed = packed.view(rows, row_bytes)
            else:
                packed = torch.empty(rows, row_bytes, dtype=torch.uint8)
            self._packed_table = packed
            # Strided views: vLLM's loader writes values and scales into the packed rows.
            return packed[:, :dim].view(torch.float8_e4m3fn), packed[:, dim:]

        def collapse_huge_pages(self) -> None:
            if self.is_peer_table or self._packed_table is not None:
                return  # engram_ray.tables.backends.host_memory prefaults huge pages itself
            super().collapse_huge_pages()

        def lookup(self, indices: torch.Tensor, out: torch.Tensor,
                   background: bool = False) -> None:
            """indices int32/int64 `[T, n_hash_cols]` (-1 = no row; vLLM passes one layer's
            columns of its `[T, L, C]` hashes) -> `out` bf16 `[T, C, dim]` or packed uint8
            rows, written in place by the table's `TableLookup` (peers' rows read in place).
            `background` (vLLM's half-grid for side-stream host prefetches) is not used: the
            tile policy sizes the grid."""
            rows = self._rows
            if rows is None:
                if not (self.is_peer_table or self._packed_table is not None):
                    return super().lookup(indices, out, background)
                rows = self._bind_rows()
            rows(indices, out)

        def _bind_rows(self):
            """This table's `TableLookup`, made once (peer tables: once the group is joined)."""
            if self.is_peer_table:
                rows = self.peer_tables.reader(self.layer_id)
            else:
                from engram_ray.tables.lookup import TableLookup
                rows = TableLookup(self.dim, table=self._packed_table)
            self._rows = rows
            return rows

        def forward(self, indices: torch.Tensor) -> torch.Tensor:
            if not self.is_peer_table:
                return super().forward(indices)
            out = torch.empty((indices.shape[0], self.n_hash_cols, self.dim),
                              dtype=torch.bfloat16, device=indices.device)
            self.lookup(indices, out)
            return out

    EngramRayEmbedding.__qualname__ = EngramRayEmbedding.__name__ = "ParallelEngramEmbedding"
    EngramRayEmbedding.__module__ = __name__
    return EngramRayEmbedding


def patch_engram_module(module) -> type:
    """Substitute the module's `ParallelEngramEmbedding` (idempotent); returns the class.
    First the installed vLLM is checked (`engram_ray.vllm.compat`): on an unsupported version,
    or one whose source breaks an assumption of this patch, the engine stops here with one
    line, not later inside a half-patched model."""
    current = module.ParallelEngramEmbedding
    if getattr(current, "engram_ray_patched", False):
        return current
    from engram_ray.vllm.compat import require_supported_vllm
    require_supported_vllm()
    module.ParallelEngramEmbedding = make_peer_embedding_class(current)
    return module.ParallelEngramEmbedding
