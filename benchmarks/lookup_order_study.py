"""Sorted host lookups, ordering variants side by side (kernels/lookup_order.py), one run:
vLLM 0.33's sorted launch against `LookupLauncher` ordering by row (`sort`: torch.sort) or by
table block (`blocks`: counting sort), each with fused graphs (ordering + lookup in one replay,
the steady state at fixed addresses) and without (`_unfused`: bucket graph + launch).

Per (rows, out): GPU ms (device events, launches queued, L2 flushed; 3 rounds taking turns),
the ordering alone (op by op, GPU ms), host us per call (bench_model_lookup.host_us) and
bitwise equality with vLLM's output. 8 GiB pinned host table (small pages), 24 columns, int32
hashes as a column slice of `[T, 2, 24]`, uniform random ids.

Usage: python benchmarks/lookup_order_study.py --json R.json --md R.md [--commit C]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_model_lookup as bench  # noqa: E402
import vllm_engram_ref  # noqa: E402
from engram_ray.kernels.lookup_launch import LookupLauncher  # noqa: E402
from engram_ray.kernels.lookup_order import FUSE_AT  # noqa: E402
from lookup_timing import GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, fill_random, stats  # noqa: E402
from lookup_timing import time_launches  # noqa: E402

TOKENS = [2731, 10923, 43691, 65536]  # 65K, 262K, 1M, 1.57M rows
ORDERS = ("sort", "blocks")
ROUNDS = 3


def variants(case) -> dict:
    fns = {"vllm_sorted": lambda h, o: case.vllm.lookup(h, o, sort=True)}
    for order in ORDERS:
        fns[order] = LookupLauncher(head_dim=HEAD_DIM, order=order, **case.source)
        fns[f"{order}_unfused"] = LookupLauncher(head_dim=HEAD_DIM, order=order,
                                                 fuse_graphs=False, **case.source)
    return fns


def order_only(fns, id_sets, budget_s) -> dict:
    """GPU ms of each ordering alone, op by op into the sorter's buffers."""
    found = {}
    for order in (o for o in ORDERS if o in fns):
        sorter = fns[order]._graph_sort
        num_rows = id_sets[0].numel()
        sorter._grow(1 << (num_rows - 1).bit_length(), id_sets[0].dtype, id_sets[0].device)
        _, values, indices = sorter._buffers[id_sets[0].dtype]
        found[order] = stats(time_launches(
            lambda i: sorter._order(id_sets[i % len(id_sets)], values, indices),
            budget_s=budget_s))["median_ms"]
    return found


def host_breakdown(fns, id_sets, out) -> dict:
    """Host us per call of the fused `blocks` path and of its parts, back to back as
    bench_model_lookup.host_us: the whole call, the replay alone (`GraphSort.replay`), the
    call key alone, and a one-kernel graph's bare `replay()` (the floor of any replay)."""
    from engram_ray.kernels.lookup_order import call_key
    launcher = fns["blocks"]
    for _ in range(FUSE_AT):
        for hashes in id_sets:
            launcher(hashes, out)
    sorter, stream = launcher._graph_sort, launcher._stream(0)
    entries = {id(h): sorter.fused[call_key(h, out)] for h in id_sets}
    tiny = torch.cuda.CUDAGraph()
    scratch = torch.zeros(1, device="cuda:0")
    with torch.cuda.graph(tiny):
        scratch.add_(1)
    parts = {"call": launcher,
             "replay": lambda h, o: sorter.replay(entries[id(h)], stream),
             "call_key": lambda h, o: call_key(h, o),
             "one_kernel_graph": lambda h, o: tiny.replay()}
    return bench.host_us(parts, id_sets, out)


def gpu_ms(fns, id_sets, out, budget_s) -> dict:
    samples = {name: [] for name in fns}
    for name, fn in fns.items():
        for _ in range(FUSE_AT):
            for hashes in id_sets:
                fn(hashes, out)
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name] += time_launches(lambda i: fn(id_sets[i % len(id_sets)], out),
                                           budget_s=budget_s / ROUNDS)
    return {name: stats(times)["median_ms"] for name, times in samples.items()}


def run(args) -> dict:
    torch.cuda.set_device(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    packed = torch.empty(args.host_gib * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8,
                         device="cuda:0")
    fill_random(packed, seed=1)
    bench.avoid_zero_scales(packed)
    case = bench.Case("host", packed, vllm_engram_ref.load_kernel(), num_sms)
    del packed
    torch.cuda.empty_cache()
    rows = []
    for out_kind in ("packed", "bf16"):
        for tokens in TOKENS:
            fns = variants(case)
            id_sets = case.ids_for(case.id_sets(tokens, seed=tokens))
            out = torch.empty(tokens, NUM_COLS, bench.WIDTH[out_kind],
                              dtype=bench.DTYPE[out_kind], device="cuda:0")
            for name in list(fns):  # a variant that fails is reported and left out
                try:
                    fns[name](id_sets[0], out)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    print(f"variant {name} failed: {exc!r}", flush=True)
                    del fns[name]
            fns_for_equal = {"vllm": fns["vllm_sorted"], **fns}
            row = dict(rows=tokens * NUM_COLS, out=out_kind,
                       bitwise_equal_vllm=bench.bitwise_equal(case, fns_for_equal, tokens,
                                                              out_kind),
                       gpu_ms=gpu_ms(fns, id_sets, out, args.budget_s),
                       order_gpu_ms=order_only(fns, id_sets, args.budget_s),
                       host_us=bench.host_us(fns, id_sets, out))
            if "blocks" in fns and tokens == TOKENS[-1]:
                row["host_us_parts"] = host_breakdown(fns, id_sets, out)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return dict(rows=rows, device=torch.cuda.get_device_name(0), commit=args.commit,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, host_gib=args.host_gib)


def markdown(result: dict) -> str:
    nan = float("nan")
    names = list(result["rows"][0]["gpu_ms"])  # every row has the first row's variants
    lines = [f"# Sorted host lookups: ordering variants vs vLLM 0.33's sorted launch "
             f"({result['device']})", "", f"{result['date']}, commit {result['commit']}, "
             f"torch {result['torch']}; {result['host_gib']} GiB pinned host table, 24 columns, "
             "int32 hashes as a column slice, uniform random ids. GPU ms: device events, "
             "launches queued, L2 flushed, medians of 3 rounds taking turns; `order` = the "
             "ordering alone (op by op); host us: back to back, every id set met before.", "",
             "| rows | out | " + " | ".join(f"{n} ms" for n in names)
             + " | order sort / blocks ms | host us: " + " / ".join(names) + " | bitwise |",
             "| ---: | --- | " + " | ".join("---:" for _ in names) + " | ---: | ---: | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['rows']:,} | {r['out']} | "
                     + " | ".join(f"{r['gpu_ms'][n]:.4f}" for n in names)
                     + f" | {r['order_gpu_ms'].get('sort', nan):.4f} / "
                     f"{r['order_gpu_ms'].get('blocks', nan):.4f}"
                     + " | " + " / ".join(f"{r['host_us'][n]:.1f}" for n in names)
                     + f" | {r['bitwise_equal_vllm']} |")
    lines += ["", "Host us per call of the fused `blocks` path at 1.57M rows, and its parts:", ""]
    for r in result["rows"]:
        if "host_us_parts" in r:
            lines.append(f"- {r['out']}: " + ", ".join(f"{k} {v:.1f}"
                                                     for k, v in r["host_us_parts"].items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--host-gib", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=0.15)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.md).write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
