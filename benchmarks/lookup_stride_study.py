"""TEMPORARY study (issue 17's last target; findings go to docs/lookup_experiments.md, then this
file is deleted): pinned host rows padded to a 32-byte stride (288 bytes: 256 values + 8
scales + 24 pad), so values start sector-aligned and load as 16-byte vectors, against the
packed 264-byte rows and vLLM 0.33's unsorted and sorted launches; plus 4-warp 128-row tiles.

Usage: python benchmarks/lookup_stride_study.py --json R.json [--host-gib 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import vllm_engram_ref  # noqa: E402
from bench_model_lookup import (DTYPE, WIDTH, Case, avoid_zero_scales, bitwise_equal,  # noqa: E402
                                capture, interleaved_wall)
from engram_ray.kernels import lookup_policy  # noqa: E402
from engram_ray.kernels.lookup_launch import LookupLauncher  # noqa: E402
from engram_ray.kernels.lookup_order import FUSE_AT  # noqa: E402
from engram_ray.kernels.lookup_policy import TileConfig  # noqa: E402
from engram_ray.tables.backends.host_memory import allocate_padded_host_table  # noqa: E402
from engram_ray.tables.lookup import TableLookup  # noqa: E402
from lookup_timing import GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, fill_random, stats, time_launches  # noqa: E402

TOKENS = [2731, 10923, 43691, 65536]  # 65K, 262K, 1M, 1.57M rows
ROUNDS = 2


@contextlib.contextmanager
def host_large(config):
    """Host lookups with 128-row tiles launched as `config` inside the block (None: policy)."""
    saved = lookup_policy.TILE_CONFIGS["host"]
    if config is not None:
        lookup_policy.TILE_CONFIGS["host"] = {**saved, 128: config}
    try:
        yield
    finally:
        lookup_policy.TILE_CONFIGS["host"] = saved


def configured(fn, config):
    def call(hashes, out):
        with host_large(config):
            return fn(hashes, out)
    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--host-gib", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=0.15)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = vllm_engram_ref.load_kernel()
    rows = args.host_gib * GIB // ROW_BYTES
    packed = torch.empty(rows, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
    fill_random(packed, seed=1)
    avoid_zero_scales(packed)
    t0 = time.perf_counter()
    case = Case("host", packed, kernel, num_sms)
    padded = allocate_padded_host_table(packed, pad_byte=0x5A)  # pad never reaches an output
    torch.cuda.synchronize()
    print(f"tables ready in {time.perf_counter() - t0:.1f} s; padded {tuple(padded.shape)}",
          flush=True)
    del packed
    torch.cuda.empty_cache()
    line = dict(split_bytes=128)
    variants = {
        "vllm": case.vllm.lookup,
        "vllm_sorted": lambda h, o: case.vllm.lookup(h, o, sort=True),
        "packed": case.patch,  # the product: TableLookup over packed pinned rows
        "packed_w4": configured(LookupLauncher(head_dim=HEAD_DIM, **case.source),
                                TileConfig(128, 16, 4, True, **line)),
        "pad288": TableLookup(HEAD_DIM, table=padded),  # policy launch, 288-byte stride
        "pad288_whole": configured(LookupLauncher(head_dim=HEAD_DIM, table=padded),
                                   TileConfig(128, 16, 8, True)),
        "pad288_whole_w4": configured(LookupLauncher(head_dim=HEAD_DIM, table=padded),
                                      TileConfig(128, 16, 4, True)),
        "pad288_w4": configured(LookupLauncher(head_dim=HEAD_DIM, table=padded),
                                TileConfig(128, 16, 4, True, **line)),
    }
    results = []
    for out_kind in ("packed", "bf16"):
        for tokens in TOKENS:
            num_rows = tokens * NUM_COLS
            fns = dict(variants)
            if num_rows < lookup_policy.TILE_POLICY["host"][0]:
                # 16-row policy launch for all: the 128-row variants would be the policy's
                for name in ("packed_w4", "pad288_whole", "pad288_whole_w4", "pad288_w4"):
                    fns.pop(name)
            equal = bitwise_equal(case, fns, tokens, out_kind)
            id_sets = case.ids_for(case.id_sets(tokens, seed=tokens))
            out = torch.empty(tokens, NUM_COLS, WIDTH[out_kind], dtype=DTYPE[out_kind],
                              device="cuda:0")
            for fn in fns.values():
                for _ in range(FUSE_AT):
                    for hashes in id_sets:
                        fn(hashes, out)
            gpu = {name: [] for name in fns}
            for round_ in range(ROUNDS):
                for name, fn in fns.items():
                    if name == "vllm" and round_:
                        continue  # unsorted: 37-55 ms a launch from 1M rows, one round
                    gpu[name].append(stats(time_launches(
                        lambda i, fn=fn: fn(id_sets[i % len(id_sets)], out),
                        budget_s=args.budget_s))["median_ms"])
            replay = {}
            for name, fn in fns.items():
                if name == "vllm" and num_rows > 300_000:
                    continue
                graphs = capture(fn, id_sets, out)
                replay[name] = lambda i, g=graphs: g[i % len(g)].replay()
            graph = interleaved_wall(replay, args.budget_s)
            row = dict(out=out_kind, rows=num_rows, bitwise_equal_vllm=equal,
                       gpu_ms=gpu, graph_ms={n: s["median_ms"] for n, s in graph.items()})
            results.append(row)
            print(json.dumps(row), flush=True)
            del replay, graph
    Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(0),
                                               results=results), indent=1))
    print_table(results)


def print_table(results) -> None:
    names = ["vllm", "vllm_sorted", "packed", "packed_w4", "pad288", "pad288_whole",
             "pad288_whole_w4", "pad288_w4"]
    print("out rows mode eq | " + " | ".join(names) + " | best pad288*/vllm_sorted")
    for row in results:
        for mode in ("gpu_ms", "graph_ms"):
            vals = {}
            for name in names:
                got = row[mode].get(name)
                if got is None or got == []:
                    continue
                vals[name] = sum(got) / len(got) if isinstance(got, list) else got
            pads = [v for n, v in vals.items() if n.startswith("pad288")]
            ratio = vals["vllm_sorted"] / min(pads) if pads else float("nan")
            cells = " | ".join(f"{vals[n]:.4f}" if n in vals else "-" for n in names)
            print(f"{row['out']} {row['rows']} {mode[:-3]} {row['bitwise_equal_vllm']} | "
                  f"{cells} | {ratio:.3f} (packed {vals['vllm_sorted'] / vals['packed']:.3f})")


if __name__ == "__main__":
    main()
