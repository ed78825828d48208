"""Engine settings per model architecture (engram_ray.vllm.engine_settings) as the Serve
app passes them (`engram_ray.serve.settings.engine_args.engine_kwargs`): DeepSeek-V4.1 runs with
vLLM's defaults (CUDA graphs on, prefix caching as vLLM decides), the tiny model eager without
prefix caching (its n-gram history is written per KV slot by Python on the host)."""

import shutil
from pathlib import Path

from engram_ray.serve.settings.engine_args import engine_kwargs
from engram_ray.serve.deploy.cluster_configs import load_serve_config
from engram_ray.vllm.engine_settings import architecture_engine_kwargs, model_architectures

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "cluster_configs"


def _app(yaml_name: str, model_dir: Path):
    app = next(iter(load_serve_config(CONFIGS / yaml_name).values()))
    deployment = app.deployment
    if deployment.checkpoint:  # fill: checkpoint reads the tables from the same folder
        deployment = deployment.replace(checkpoint=str(model_dir))
    return app.replace(deployment=deployment,
                       serving=app.serving.replace(model_source=str(model_dir)))


def test_deepseek_engines_keep_vllms_defaults(tmp_path):
    shutil.copy(CONFIGS / "models" / "deepseek-v4.1-flash.json", tmp_path / "config.json")
    assert model_architectures(str(tmp_path)) == ["DeepseekV41ForCausalLM"]
    kwargs = engine_kwargs(_app("serve_deepseek_v41_flash.yaml", tmp_path))
    assert "enforce_eager" not in kwargs and "enable_prefix_caching" not in kwargs
    assert kwargs["engram_config"] == {"cpu_offload": False}  # the YAML's own settings stay


def test_tiny_engines_run_eager_without_prefix_caching(tmp_path):
    from engram_ray.vllm.tiny_checkpoint import ARCHITECTURE
    (tmp_path / "config.json").write_text('{"architectures": ["%s"]}' % ARCHITECTURE)
    kwargs = engine_kwargs(_app("serve_local_tiny.yaml", tmp_path))
    assert kwargs["enforce_eager"] is True and kwargs["enable_prefix_caching"] is False


def test_an_unreadable_config_sets_nothing_at_the_build_and_is_refused_on_an_engine_node(
        tmp_path):
    """#46 item 1: no silent slow mode. A build on a node without the model's folder sets no
    architecture settings (not the tiny model's eager mode); each member reads config.json on
    its own node (`MemberEngine.set_kwargs`) and refuses to start, naming the path, where it
    cannot."""
    import pytest

    from engram_ray.errors import EngramRayError

    missing = tmp_path / "missing"
    assert model_architectures(str(missing)) is None
    assert architecture_engine_kwargs(str(missing)) == {}
    kwargs = engine_kwargs(_app("serve_deepseek_v41_flash.yaml", missing))
    assert "enforce_eager" not in kwargs and "enable_prefix_caching" not in kwargs
    with pytest.raises(EngramRayError, match=f"no config.json readable for serving.model_source "
                                             f"'{missing}' on this engine's node"):
        engine_kwargs(_app("serve_deepseek_v41_flash.yaml", missing), on_engine_node=True)


def test_a_member_sets_its_architectures_settings_read_on_its_own_node(tmp_path):
    """The build could not read the tiny model's config (its LLMConfig has no eager mode); the
    member, whose node can, starts its engine eager without prefix caching."""
    from types import SimpleNamespace

    from engram_ray.planning.grouping import PeerGroupPlan
    from engram_ray.serve.app import llm_config
    from engram_ray.serve.member.engine import MemberEngine
    from engram_ray.vllm.tiny_checkpoint import ARCHITECTURE

    app = _app("serve_local_tiny.yaml", tmp_path)
    group = PeerGroupPlan("group-0", SimpleNamespace(domain_id="d0"), 0,
                          app.deployment.peer_group_size)
    config = llm_config(app, group)  # built before the folder is readable
    assert "enforce_eager" not in config.engine_kwargs
    (tmp_path / "config.json").write_text('{"architectures": ["%s"]}' % ARCHITECTURE)
    member = MemberEngine(SimpleNamespace(_llm_config=config, _app=None))
    member.set_kwargs(app)
    assert config.engine_kwargs["enforce_eager"] is True
    assert config.engine_kwargs["enable_prefix_caching"] is False
