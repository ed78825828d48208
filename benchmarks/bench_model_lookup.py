"""The Engram lookup as vLLM's model calls it, beside vLLM's own kernel (0.33 or 0.34).

Three callables per case, on the same rows (DeepSeek-V4.1-Flash: 264-byte rows, 24 columns):
- `vllm`: the `--vllm` release's `_engram_lookup_kernel` (default 0.34; the same text in 0.33)
  launched as `ParallelEngramEmbedding.lookup` does (benchmarks/vllm_engram_ref.py; its own
  table layout); host tables also `vllm_sorted` (its GB200 path) and `vllm_ms` is the faster
  of the two;
- `kernel`: engram-ray's kernel alone, `engram_lookup(ids, into=out)` on contiguous ids;
- `patch`: `engram_ray.tables.lookup.TableLookup`, the function the DeepSeek patch calls, on
  int32 hashes as one layer's column slice of `[T, 2, 24]`, into a persistent staging buffer
  (packed rows, as the patch allocates them).
Modes: `gpu` (device events per launch, launches queued behind a sleep kernel, L2 flushed),
`eager` (one call + sync on the host clock), `graph` (CUDA-graph replay + sync, host clock;
both taking samples callable by callable in turn; median, p10 and p90 kept);
id sets rotate so no launch rereads a recent one's rows (benchmarks/lookup_timing.py). Host
time per call: mean of 50 back-to-back calls, GPU held by a sleep kernel; best of 10 rounds.
Outputs are checked bitwise against vLLM's (ids with -1 entries) in the same run.
Tables: HBM and peer slices from one 16 GiB table (HBM lookups do not depend on the table's
size); pinned host tables of 32 GiB (the targets': host memory holds tables too large for HBM,
DeepSeek-V4.1-Flash's are 94 GiB each; two copies, ours and vLLM's, fit the machine's 128 GiB)
and of 16 GiB (`dense`, the size of #17's own measurement, reported beside the targets: a
lookup reads twice the share of its rows, and from 2.4% of a table's rows no launch of ours
reached vLLM's sorted one; docs/lookup_experiments.md).

Usage: python benchmarks/bench_model_lookup.py --json R.json --md R.md [--vllm 0.33|0.34]
[--quick] [--results DIR]
(latest.md and a history.jsonl line go to benchmarks/results/model_lookup/ unless --results
names another folder; benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.kernels.lookup import engram_lookup  # noqa: E402
from engram_ray.kernels.lookup_launch import LookupLauncher  # noqa: E402
from engram_ray.kernels.lookup_order import FUSE_AT  # noqa: E402
from engram_ray.tables.lookup import TableLookup  # noqa: E402

import model_lookup_report as report  # noqa: E402
import vllm_engram_ref  # noqa: E402
from common import add_results_argument  # noqa: E402
from lookup_timing import (GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, capture,  # noqa: E402
                           fill_random, host_us, interleaved_wall, num_id_sets, stats,
                           time_launches)

TOKENS = [64, 683, 2731, 10923, 43691, 65536]  # 1.5K, 16K, 65K, 262K, 1M, 1.57M rows
NUM_LAYERS = 2
AA_MAX_ROWS = 16_392  # up to here vLLM is also timed against itself (eager, graph)
SLOW_BASELINE = 1.5  # time_modes: a vLLM launch this much slower than its other one (GPU time)
WIDTH = {"packed": ROW_BYTES, "bf16": HEAD_DIM}
DTYPE = {"packed": torch.uint8, "bf16": torch.bfloat16}


def avoid_zero_scales(packed: torch.Tensor, chunk_rows: int = 1 << 22) -> None:
    """ue8m0 scale byte 0 is the one input where the two kernels' bf16 differ: vLLM's
    `(e << 23)` makes it 0.0, engram-ray (and its torch reference) the exact 2^-127. A real
    checkpoint has no such scales; the benchmark table gets 1 instead (0xFF, the NaN, is
    already absent from random tables)."""
    for start in range(0, packed.shape[0], chunk_rows):
        packed[start:start + chunk_rows, HEAD_DIM:].clamp_(min=1)


class Case:
    """One placement's tables (ours packed, vLLM's layout) and the callables over them."""

    def __init__(self, placement: str, packed_gpu: torch.Tensor, vllm_kernel, num_sms: int):
        self.placement = placement
        if placement == "peer":
            half = packed_gpu.shape[0] // 4 * 2  # even: slices start 16-byte aligned
            parts = [packed_gpu[:half], packed_gpu[half:2 * half]]
            bases = torch.tensor([p.data_ptr() for p in parts], device="cuda:0")
            self.source = dict(peer_bases=bases, rows_per_rank=half)
            self.num_rows = 2 * half
        else:
            parts = [packed_gpu]
            table = packed_gpu
            if placement == "host":
                from engram_ray.tables.backends.host_memory import allocate_host_table
                table = allocate_host_table(packed_gpu.numel()).view(-1, ROW_BYTES)
                table.copy_(packed_gpu)
            self.source = dict(table=table)
            self.num_rows = packed_gpu.shape[0]
        self.vllm = vllm_engram_ref.VllmTable(vllm_kernel, parts, HEAD_DIM, placement, num_sms)
        self.patch = TableLookup(HEAD_DIM, **self.source)
        self.contiguous: dict[int, torch.Tensor] = {}
        torch.cuda.synchronize()

    def callables(self, out_kind: str) -> dict:
        """name -> fn(hashes, out): `hashes` is what the model hands the lookup, layer 1's
        int32 columns of `[T, 2, C]` (a view); `kernel` gets them contiguous (`ids_for`)."""
        def kernel(hashes, out):
            return engram_lookup(self.contiguous.get(id(hashes), hashes), head_dim=HEAD_DIM,
                                 out=out_kind, into=out, **self.source)

        fns = {"vllm": self.vllm.lookup, "kernel": kernel, "patch": self.patch}
        if self.placement == "host":
            fns["vllm_sorted"] = lambda h, o: self.vllm.lookup(h, o, sort=True)
        return fns

    def ids_for(self, id_sets: list[torch.Tensor]) -> list[torch.Tensor]:
        """Layer 1's columns of each id set, and (for `kernel`, made before timing) their
        contiguous copies."""
        views = [h[:, 1] for h in id_sets]
        self.contiguous = {id(v): v.contiguous() for v in views}
        return views

    def id_sets(self, tokens: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda:0").manual_seed(seed)
        return [torch.randint(0, self.num_rows, (tokens, NUM_LAYERS, NUM_COLS), generator=gen,
                              device="cuda:0", dtype=torch.int32)
                for _ in range(num_id_sets(tokens * NUM_COLS))]


def bitwise_equal(case, fns, tokens, out_kind) -> bool:
    """Every callable's output, at its first call and FUSE_AT calls later on the same ids
    and output (sorted host lookups: op by op, then a fused graph replay), equal to vLLM's
    first (ids with -1 entries)."""
    hashes = case.id_sets(tokens, seed=99)[0]
    flat = hashes[:, 1].reshape(-1)
    flat[::97] = -1  # vLLM's DEAD_ID rows: zeros from both
    hashes[:, 1].copy_(flat.view(tokens, NUM_COLS))
    hashes = hashes[:, 1]
    first = None
    for fn in fns.values():
        out = torch.empty(tokens, NUM_COLS, WIDTH[out_kind], dtype=DTYPE[out_kind],
                          device="cuda:0")
        for _ in range(FUSE_AT + 1):
            out.view(torch.uint8).fill_(0xA5)
            fn(hashes, out)
            torch.cuda.synchronize()
            if first is None:
                first = out.view(torch.uint8).clone()
            elif not torch.equal(first, out.view(torch.uint8)):
                return False
    return True


def time_modes(fns, id_sets, out, budget_s: float) -> dict:
    """{mode: {name: stats}} for gpu, eager and graph. The host-clock modes interleave the
    callables sample by sample, in an order rotated each time, so drift falls on each alike
    (the same small graph replay moved 16.5-22 us between rounds of whole blocks,
    docs/lookup_experiments.md, pinned host tables against vLLM 0.33); small lookups also
    time vLLM against itself (`vllm_again`: its own graphs), the spread two equal callables
    show. vLLM's unsorted host launch is left out of the host-clock modes where its GPU time
    is over SLOW_BASELINE x its sorted launch's (it cannot be the faster there: the sort costs
    tens of us of host time, the gap is milliseconds); `found["left_out"]` names it."""
    found = {"gpu": {}}
    for name, fn in fns.items():
        for _ in range(FUSE_AT):  # steady state: fused graphs captured before timing
            for hashes in id_sets:
                fn(hashes, out)
        found["gpu"][name] = stats(time_launches(
            lambda i: fn(id_sets[i % len(id_sets)], out), budget_s=budget_s))
    gpu = {name: s["median_ms"] for name, s in found["gpu"].items()}
    found["left_out"] = [name for name in ("vllm",) if "vllm_sorted" in gpu
                         and gpu[name] > SLOW_BASELINE * gpu["vllm_sorted"]]
    timed = {name: fn for name, fn in fns.items() if name not in found["left_out"]}
    graphs = {name: capture(fn, id_sets, out) for name, fn in timed.items()}
    eager = {name: (lambda i, fn=fn: fn(id_sets[i % len(id_sets)], out))
             for name, fn in timed.items()}
    replay = {name: (lambda i, g=g: g[i % len(g)].replay()) for name, g in graphs.items()}
    if out.shape[0] * out.shape[1] <= AA_MAX_ROWS and "vllm" in eager:
        eager["vllm_again"] = eager["vllm"]
        again = capture(fns["vllm"], id_sets, out)
        replay["vllm_again"] = lambda i: again[i % len(again)].replay()
    found["eager"] = interleaved_wall(eager, budget_s)
    found["graph"] = interleaved_wall(replay, budget_s)
    return found


def random_packed(gib: int) -> torch.Tensor:
    packed = torch.empty(gib * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
    fill_random(packed, seed=1)
    avoid_zero_scales(packed)
    return packed


def tables(args):
    """(placement, table GiB, dense, packed rows on the GPU) of each case in turn: HBM and peer
    from one `hbm_gib` table, then pinned host tables of `host_gib` and (`dense_host_gib`)
    from a second (the first freed: only one source lives on the GPU at a time)."""
    if {"hbm", "peer"} & set(args.placements):
        packed = random_packed(args.hbm_gib)
        for placement in ("hbm", "peer"):
            if placement in args.placements:
                yield placement, args.hbm_gib, False, packed
        del packed
        torch.cuda.empty_cache()
    if "host" not in args.placements:
        return
    packed = random_packed(max(args.host_gib, args.dense_host_gib))
    for gib, dense in ((args.host_gib, False), (args.dense_host_gib, True)):
        if gib:
            yield "host", gib, dense, packed[:gib * GIB // ROW_BYTES]
            getattr(torch._C, "_host_emptyCache", lambda: None)()  # its pinned copies freed


def run(args) -> dict:
    torch.cuda.set_device(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = vllm_engram_ref.load_kernel(args.vllm)
    tokens = TOKENS[:3:2] + TOKENS[-1:] if args.quick else TOKENS
    cases, host = [], []
    for placement, table_gib, dense, source in tables(args):
        case = Case(placement, source, kernel, num_sms)
        for out_kind in ("bf16", "packed"):
            for num_tokens in tokens:
                id_sets = case.ids_for(case.id_sets(num_tokens, seed=num_tokens))
                fns = case.callables(out_kind)
                out = torch.empty(num_tokens, NUM_COLS, WIDTH[out_kind], dtype=DTYPE[out_kind],
                                  device="cuda:0")
                equal = bitwise_equal(case, fns, num_tokens, out_kind)
                timed = time_modes(fns, id_sets, out, args.budget_s)
                cases.extend(report.case_rows(placement, out_kind, num_tokens * NUM_COLS,
                                              timed, equal, table_gib, dense))
                if num_tokens in (64, 2731, 65536):
                    if placement == "host":
                        fns["patch_unfused"] = LookupLauncher(
                            head_dim=HEAD_DIM, fuse_graphs=False, **case.source)
                    kept = {k: f for k, f in fns.items() if k not in timed["left_out"]}
                    host.append(dict(placement=placement, out=out_kind, table_gib=table_gib,
                                     dense=dense, rows=num_tokens * NUM_COLS,
                                     **host_us(kept, id_sets, out, warm_passes=FUSE_AT)))
                print(json.dumps(cases[-1]), flush=True)
        del case, source
        torch.cuda.empty_cache()
    return report.finish(cases, host, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--hbm-gib", type=int, default=16)
    parser.add_argument("--host-gib", type=int, default=32,
                        help="pinned host table (the targets' host cases; two copies: ours, "
                        "vLLM's)")
    parser.add_argument("--dense-host-gib", type=int, default=16,
                        help="a second, smaller host table, reported beside the targets "
                        "(0: none)")
    parser.add_argument("--budget-s", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="3 sizes")
    parser.add_argument("--vllm", choices=vllm_engram_ref.VERSIONS, default="0.34",
                        help="the vLLM release whose kernel is the anchor (.vllm_ref/<it>/)")
    parser.add_argument("--placements", nargs="+", default=["hbm", "peer", "host"],
                        choices=["hbm", "peer", "host"])
    add_results_argument(parser, "model_lookup")
    args = parser.parse_args()
    if args.host_gib < 1 or args.dense_host_gib < 0:
        parser.error(f"--host-gib {args.host_gib} / --dense-host-gib {args.dense_host_gib}: "
                     "expected >= 1 / >= 0 (0: no dense table)")
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.md).write_text(report.markdown(result))
    report.write_history(result, args.results)
    print(report.summary(result))


if __name__ == "__main__":
    main()
