"""Sorted launches of pinned host lookups against vLLM 0.33's sorted launch, by table density
(#17's dense-table gap). A study: one run on one H200; its findings go to
docs/lookup_experiments.md and the script retires once they are recorded.

`bench_model_lookup` at 63637e3 met every target on a 32 GiB host table, but on 8, 12 and
16 GiB tables (16 GiB: the issue's own) the patch path was 0.96-0.99x vLLM's sorted launch
in 9 of 36 cases each, from 65K rows. The policy knows two launches per placement (16- and
128-row tiles) swept on an 8 GiB table at 1.57M rows. This times, on the same ordered path
(the launcher's ordering + gather, no fused graphs) and against vLLM's sorted launch in the
same rounds: grid, warps, prefetch, tile rows 16-128 and cut loads, on 8, 16 and 32 GiB
tables (one pinned allocation, sliced), 65K-1.57M rows, packed and bf16 output, GPU time
(device events, launches queued behind a sleep kernel, L2 flushed), callables taking turns.
Every variant's output is checked bitwise against vLLM's sorted launch on ids with -1s.

Usage: python benchmarks/host_tile_study.py --json R.json [--host-gib 8 16 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.kernels import lookup_policy  # noqa: E402
from engram_ray.kernels.lookup_launch import LookupLauncher  # noqa: E402
from engram_ray.kernels.lookup_order import FUSE_AT  # noqa: E402
from engram_ray.kernels.lookup_policy import TileConfig  # noqa: E402
from engram_ray.tables.backends.host_memory import allocate_host_table  # noqa: E402
from engram_ray.tables.lookup import TableLookup  # noqa: E402

import vllm_engram_ref  # noqa: E402
from bench_model_lookup import DTYPE, WIDTH, random_packed  # noqa: E402
from common import environment  # noqa: E402
from lookup_timing import GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, stats, time_launches  # noqa: E402

TOKENS = (2731, 10923, 43691, 65536)  # 65K, 262K, 1M, 1.57M rows
NUM_SETS = 4
# (tile rows, programs per SM, warps, prefetch, cut loads at): the committed two first.
VARIANTS = [(16, 1, 2, True, 0), (128, 16, 8, True, 128),
            (16, 1, 4, False, 0), (16, 1, 4, True, 0), (16, 2, 2, True, 0), (16, 2, 4, True, 0),
            (16, 4, 4, True, 0), (16, 1, 2, True, 128), (16, 1, 4, True, 128),
            (32, 1, 4, True, 0), (32, 2, 4, True, 0), (32, 1, 4, True, 128),
            (64, 1, 8, True, 128), (64, 2, 8, True, 128), (64, 1, 4, True, 128),
            (128, 1, 8, True, 128), (128, 2, 8, True, 128), (128, 4, 8, True, 128)]


def name_of(v) -> str:
    rows, per_sm, warps, prefetch, cut = v
    return f"r{rows}x{per_sm}w{warps}{'p' if prefetch else ''}{f'c{cut}' if cut else ''}"


def launcher_for(table: torch.Tensor, variant, probes: list) -> LookupLauncher:
    """A launcher fixed to `variant` (its sorted launches prepared on every probe (ids, out),
    with the variant's cut loads put in the policy's table while they are prepared)."""
    rows, per_sm, warps, prefetch, cut = variant
    launcher = LookupLauncher(head_dim=HEAD_DIM, table=table, block_rows=rows,
                              programs_per_sm=per_sm, num_warps=warps, prefetch=prefetch,
                              sort_rows=True, fuse_graphs=False)
    configs = lookup_policy.TILE_CONFIGS[launcher.placement]
    saved = configs.get(rows)
    configs[rows] = TileConfig(rows, per_sm, warps, prefetch, split_bytes=cut)
    try:
        for ids, out in probes:
            launcher(ids, out)
        torch.cuda.synchronize()
    finally:
        if saved is None:
            del configs[rows]
        else:
            configs[rows] = saved
    return launcher


def id_sets(tokens: int, num_rows: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda:0").manual_seed(seed)
    return [torch.randint(0, num_rows, (tokens, 2, NUM_COLS), generator=gen, device="cuda:0",
                          dtype=torch.int32)[:, 1] for _ in range(NUM_SETS)]


def timed_rounds(fns: dict, budget_s: float, num_rounds: int) -> dict:
    rounds = {name: [] for name in fns}
    for _ in range(num_rounds):
        for name, fn in fns.items():
            rounds[name].append(stats(time_launches(fn, budget_s=budget_s))["median_ms"])
    return {name: {"ms": statistics.median(r), "rounds": r} for name, r in rounds.items()}


def check_equal(fns: dict, hashes: torch.Tensor, out: torch.Tensor) -> dict:
    reference, equal = None, {}
    for name, fn in fns.items():
        out.view(torch.uint8).fill_(0xA5)
        fn(hashes, out)
        torch.cuda.synchronize()
        if reference is None:
            reference = out.view(torch.uint8).clone()
        equal[name] = bool(torch.equal(reference, out.view(torch.uint8)))
    return equal


def run_table(pinned, packed_gpu, gib, kernel, num_sms, args, found) -> None:
    rows = gib * GIB // ROW_BYTES
    table = pinned[:rows]
    vllm = vllm_engram_ref.VllmTable(kernel, [packed_gpu[:rows]], HEAD_DIM, "host", num_sms)
    torch.cuda.synchronize()
    sets = {t: id_sets(t, rows, seed=t) for t in TOKENS}
    outs = {(t, kind): torch.empty(t, NUM_COLS, WIDTH[kind], dtype=DTYPE[kind], device="cuda:0")
            for t in TOKENS for kind in ("packed", "bf16")}
    probes = [(sets[t][0], outs[t, kind]) for t, kind in outs]
    launchers = {name_of(v): launcher_for(table, v, probes) for v in VARIANTS}
    patch = TableLookup(HEAD_DIM, table=table)
    print(f"{gib} GiB: {rows} rows, {len(launchers)} launchers ready", flush=True)
    for tokens in TOKENS:
        for kind in ("packed", "bf16"):
            out, ids = outs[tokens, kind], sets[tokens]
            fns = {"vllm_sorted": lambda h, o: vllm.lookup(h, o, sort=True), "patch": patch,
                   **launchers}
            check = ids[0].clone()
            check.view(-1)[::97] = -1
            equal = check_equal(fns, check, out)
            for _ in range(FUSE_AT + 1):  # the patch's fused graphs captured before timing
                for h in ids:
                    patch(h, out)
            timed = timed_rounds({n: (lambda i, f=f: f(ids[i % NUM_SETS], out))
                                  for n, f in fns.items()}, args.budget_s, args.rounds)
            case = {"table_gib": gib, "rows": tokens * NUM_COLS, "out": kind,
                    "share_pct": 100 * tokens * NUM_COLS / rows, "bitwise": equal, **timed}
            found["cases"].append(case)
            base = timed["vllm_sorted"]["ms"]
            best = min((n for n in launchers), key=lambda n: timed[n]["ms"])
            print(f"{gib} GiB {tokens * NUM_COLS} {kind}: vllm {base:.3f} patch "
                  f"{timed['patch']['ms']:.3f} ({base / timed['patch']['ms']:.3f}x) best {best} "
                  f"{timed[best]['ms']:.3f} ({base / timed[best]['ms']:.3f}x) bitwise "
                  f"{all(equal.values())}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--host-gib", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--budget-s", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = vllm_engram_ref.load_kernel()
    found = {**environment(gpu=True), "variants": {name_of(v): asdict(TileConfig(
        v[0], v[1], v[2], v[3], split_bytes=v[4])) for v in VARIANTS}, "cases": []}
    packed_gpu = random_packed(max(args.host_gib))
    pinned = allocate_host_table(packed_gpu.numel()).view(-1, ROW_BYTES)
    pinned.copy_(packed_gpu)
    for gib in args.host_gib:
        run_table(pinned, packed_gpu, gib, kernel, num_sms, args, found)
        torch.cuda.empty_cache()  # vLLM's copy of this table freed
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        Path(args.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
