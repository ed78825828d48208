"""What limits Engram lookups on one GPU: random-read ceilings, cache hints, host page size.

Measures, on the table layouts the lookup benchmark uses (benchmarks/bench_lookup.py):
- sequential ceilings: device copy (read + write), read only, write only;
- random reads of one chunk per id from a `--hbm-gib` HBM table (no output but one 8-byte
  word per id): chunk sizes 32 B .. 4 KiB, 264-byte packed rows among them, 8- and 16-byte
  loads; the bytes the DRAM must move are whole 32-byte sectors;
- the lookup kernel at 262K and 1.57M rows with other launches and cache hints (L2-only loads,
  evict-first loads, streaming stores), checked equal to the default launch;
- host tables on small pages and on transparent huge pages: lookups whose ids fall inside a
  window of 256 KiB .. the whole table (GPU address translation reach), and small lookups of
  16- and 128-row tiles timed interleaved (the policy's noise floor).
- `split`: lookups from HBM and host tables with each row's loads cut at a sector or a line
  (`TileConfig.split_bytes`, kept for peer tables) against the committed launches;
- `fetch`: the same lookups (HBM; half-remote peer lookups too where 2 GPUs are present) and
  264-byte random reads under each L2 fetch granularity the CUDA context allows
  (`cudaLimitMaxL2FetchGranularity`: a per-process hint, 32/64/128 bytes): does fetching only
  the 32-byte sectors a row touches (288 B per 264-byte row instead of five 64-byte units) help?
`--ncu` runs one launch of each kind between cudaProfilerStart/Stop for Nsight Compute
(`ncu --profile-from-start off ...`): DRAM bytes per looked-up row (`--l2-fetch` sets the
granularity first).
Usage: python benchmarks/lookup_limits.py --json R.json --md R.md [--parts hbm hints host]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

from engram_ray.host_memory import allocate_host_table, huge_page_bytes  # noqa: E402
from engram_ray.kernels import lookup as kernel  # noqa: E402
from lookup_timing import (GIB, HEAD_DIM, NUM_COLS, ROW_BYTES, fill_random,  # noqa: E402
                           launch_config, num_id_sets, stats, time_launches)

SECTOR = 32
LARGE_ROWS = (262152, 1572864)   # 10923 and 65536 tokens x 24 columns


@triton.jit(do_not_specialize=["num_rows", "num_programs"])
def _gather_read_kernel(src, row_ids, out, num_rows, num_programs, STRIDE: tl.constexpr,
                        MAIN_WORDS: tl.constexpr, TAIL_WORDS: tl.constexpr,
                        ALIGN: tl.constexpr, BLOCK_R: tl.constexpr,
                        FROM_ADDRESS: tl.constexpr = False, SPLIT_WORDS: tl.constexpr = 0):
    """out[i] = XOR of the 8-byte words of chunk row_ids[i] (bytes [id * STRIDE, + 8 x
    (MAIN_WORDS + TAIL_WORDS))): every chunk byte is read, 8 bytes per id are written.
    FROM_ADDRESS: `src` is an int64 device address (another GPU's memory, peer-mapped).
    SPLIT_WORDS 4/16 (33-word chunks): two loads cut at the chunk's first 32-byte sector /
    128-byte line boundary, as the lookup kernel's `split_bytes` peer loads, instead of 32
    words + the last one."""
    num_tiles = tl.cdiv(num_rows, BLOCK_R)
    words = tl.arange(0, MAIN_WORDS)
    if FROM_ADDRESS:
        base = src.to(tl.pointer_type(tl.uint8))
    else:
        base = src
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs):
        pos = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        in_range = pos < num_rows
        row = tl.load(row_ids + pos, mask=in_range, other=0)
        ptr = tl.multiple_of((base + row * STRIDE).to(tl.pointer_type(tl.uint64)), ALIGN)
        if SPLIT_WORDS:
            head_words = (SPLIT_WORDS - (ptr.to(tl.int64) // 8) % SPLIT_WORDS)[:, None]
            lane4 = tl.arange(0, SPLIT_WORDS)[None, :]
            acc = tl.xor_sum(tl.load(ptr[:, None] + lane4, mask=in_range[:, None] & (
                lane4 < head_words), other=0), axis=1)
            acc ^= tl.xor_sum(tl.load(ptr[:, None] + head_words + words[None, :],
                                      mask=in_range[:, None] & (words[None, :] < MAIN_WORDS
                                                                + TAIL_WORDS - head_words),
                                      other=0), axis=1)
        else:
            acc = tl.xor_sum(tl.load(ptr[:, None] + words[None, :], mask=in_range[:, None],
                                     other=0), axis=1)
        if TAIL_WORDS > 0 and not SPLIT_WORDS:
            tail = tl.arange(0, TAIL_WORDS)
            acc ^= tl.xor_sum(tl.load(ptr[:, None] + MAIN_WORDS + tail[None, :],
                                      mask=in_range[:, None], other=0), axis=1)
        tl.store(out + pos, acc, mask=in_range)


def gather_read(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, stride: int,
                chunk: int, align: int, block_rows: int = 16, per_sm: int = 8,
                split_bytes: int = 0) -> None:
    words = chunk // 8
    main = 1 << (words.bit_length() - 1)
    tail = words - main
    if tail & (tail - 1):
        raise ValueError(f"chunk {chunk}: words beyond the power of two must be a power of two")
    if split_bytes and (words != 33 or align != 8):
        raise ValueError(f"split reads are for 264-byte rows (8-byte aligned); chunk {chunk}")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = max(1, min(triton.cdiv(ids.numel(), block_rows), num_sms * per_sm))
    remote = table.device != ids.device     # another GPU's memory: pass its address
    _gather_read_kernel[(programs,)](table.data_ptr() if remote else table, ids, out,
                                     ids.numel(), programs, STRIDE=stride, MAIN_WORDS=main,
                                     TAIL_WORDS=tail, ALIGN=align, BLOCK_R=block_rows,
                                     FROM_ADDRESS=remote, SPLIT_WORDS=split_bytes // 8,
                                     num_warps=4)


def sectors(chunk: int, stride: int) -> float:
    """Mean 32-byte sectors a chunk at offset id * stride touches (ids uniform)."""
    period = SECTOR // math.gcd(stride, SECTOR)
    offsets = [(i * stride) % SECTOR for i in range(period)]
    return sum(-(-(o + chunk) // SECTOR) for o in offsets) / period


def split_of(label: str) -> int:
    """split_bytes of a read case: where its labelled loads are cut."""
    return 32 if "cut at a sector" in label else 128 if "cut at a line" in label else 0


def timed(fn, budget_s: float) -> dict:
    return stats(time_launches(fn, budget_s=budget_s))


def sequential_ceilings(budget_s: float) -> dict:
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    src.random_()
    ids = torch.arange(src.numel() // 256, device="cuda:0")
    words = torch.empty(ids.numel(), dtype=torch.int64, device="cuda:0")
    copy = timed(lambda i: dst.copy_(src), budget_s)["median_ms"]
    read = timed(lambda i: gather_read(src, ids, words, 256, 256, 16), budget_s)["median_ms"]
    write = timed(lambda i: dst.fill_(i % 251), budget_s)["median_ms"]
    return {"copy_GBps": 2 * src.numel() / copy / 1e6,
            "read_GBps": (src.numel() + 16 * ids.numel()) / read / 1e6,
            "write_GBps": dst.numel() / write / 1e6}


# (label, stride, chunk, alignment of the chunk start)
RANDOM_READS = [("sector 32 B", 32, 32, 16), ("64 B", 64, 64, 16), ("128 B", 128, 128, 16),
                ("256 B, 16-B loads", 256, 256, 16), ("256 B, 8-B loads", 256, 256, 8),
                ("264-B rows (packed Engram), 8-B loads", 264, 264, 8),
                ("264-B rows, loads cut at a sector boundary", 264, 264, 8),
                ("264-B rows, loads cut at a line boundary", 264, 264, 8),
                ("272-B stride, 16-B loads", 272, 272, 16), ("288 B (9 sectors)", 288, 288, 32),
                ("512 B", 512, 512, 16), ("1 KiB", 1024, 1024, 16), ("4 KiB", 4096, 4096, 16)]


def random_reads(table: torch.Tensor, budget_s: float, num_ids: int) -> list[dict]:
    found = []
    out = torch.empty(num_ids, dtype=torch.int64, device="cuda:0")
    generator = torch.Generator(device="cuda:0").manual_seed(7)
    for label, stride, chunk, align in RANDOM_READS:
        rows = table.numel() // stride
        ids = [torch.randint(0, rows, (num_ids,), generator=generator, device="cuda:0")
               for _ in range(4)]
        for block_rows, per_sm in ((16, 8), (16, 16), (64, 4)):
            if chunk * block_rows > 64 * 1024:
                continue
            t = timed(lambda i: gather_read(table, ids[i % 4], out, stride, chunk, align,
                                            block_rows, per_sm, split_of(label)), budget_s)
            ms = t["median_ms"]
            found.append({"case": label, "stride": stride, "chunk": chunk, "align": align,
                          "block_rows": block_rows, "programs_per_sm": per_sm, **t,
                          "chunk_GBps": num_ids * chunk / ms / 1e6,
                          "sector_GBps": num_ids * sectors(chunk, stride) * SECTOR / ms / 1e6,
                          "ids_per_ns": num_ids / ms / 1e6})
            print(json.dumps(found[-1]), flush=True)
    return found


HINTS = {"load .cg": {"load_cache": ".cg"}, "load evict_first": {"load_evict": "evict_first"},
         "store .cs": {"store_cache": ".cs"},
         "load .cg + store .cs": {"load_cache": ".cg", "store_cache": ".cs"}}
LAUNCHES = [kernel.TileConfig(16, 8, 4), kernel.TileConfig(16, 16, 4, True),
            kernel.TileConfig(32, 4, 4), kernel.TileConfig(32, 8, 4, True),
            kernel.TileConfig(64, 2, 4), kernel.TileConfig(16, 12, 4)]


def lookup_id_sets(num_ids: int, num_rows: int, generator) -> list[torch.Tensor]:
    """Sets (`num_id_sets`) of uniform random ids `[num_rows / 24, 24]` over a table of
    `num_ids` rows."""
    return [torch.randint(0, num_ids, (num_rows // NUM_COLS, NUM_COLS), generator=generator,
                          device="cuda:0") for _ in range(num_id_sets(num_rows))]


def moved_bytes(num_rows: int, out: str) -> int:
    """Bytes a lookup moves: 264 read + the output row written, per row."""
    return num_rows * (ROW_BYTES + (ROW_BYTES if out == "packed" else 2 * HEAD_DIM))


def timed_launch(table: torch.Tensor, placement: str, config, ids: list, out: str,
                 expected: torch.Tensor, budget_s: float) -> tuple[bool, dict]:
    """(output equal to `expected`, timing) of lookups of `table` with `config` as the
    placement's launch for its tile rows."""
    with launch_config(placement, config):
        got = kernel.engram_lookup(ids[0], head_dim=HEAD_DIM, table=table, out=out,
                                   block_rows=config.block_rows)
        equal = torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        return equal, timed(lambda i: kernel.engram_lookup(
            ids[i % len(ids)], head_dim=HEAD_DIM, table=table, out=out,
            block_rows=config.block_rows), budget_s)


def lookup_variants(table: torch.Tensor, budget_s: float) -> list[dict]:
    """Each launch, the first with each hint; outputs checked equal to the default launch's."""
    found = []
    generator = torch.Generator(device="cuda:0").manual_seed(11)
    for num_rows in LARGE_ROWS:
        ids = lookup_id_sets(table.shape[0], num_rows, generator)
        for out in ("packed", "bf16"):
            expected = kernel.engram_lookup(ids[0], head_dim=HEAD_DIM, table=table, out=out)
            cases = [(f"{c.block_rows}x{c.programs_per_sm}/SM w{c.num_warps}"
                      f"{' prefetch' if c.prefetch else ''}", c, "none") for c in LAUNCHES]
            cases += [(f"16x8/SM w4 {hint}", replace(LAUNCHES[0], **HINTS[hint]), hint)
                      for hint in HINTS]
            for name, config, hint in cases:
                equal, t = timed_launch(table, "hbm", config, ids, out, expected, budget_s)
                found.append({"rows": num_rows, "out": out, "variant": name, "hint": hint,
                              "equal_to_default": equal, **t,
                              "GBps": moved_bytes(num_rows, out) / t["median_ms"] / 1e6})
                print(json.dumps(found[-1]), flush=True)
    return found


def split_variants(table: torch.Tensor, placement: str, budget_s: float) -> list[dict]:
    """The committed launches of `placement` against the same with each row's loads cut at a
    32-byte sector or 128-byte line (`TileConfig.split_bytes`), prefetch on and off, 16- and
    128-row tiles; outputs checked equal to the committed launch's. Rounds interleaved."""
    found = []
    generator = torch.Generator(device="cuda:0").manual_seed(17)
    for num_rows in LARGE_ROWS:
        ids = lookup_id_sets(table.shape[0], num_rows, generator)
        for out in ("packed", "bf16"):
            expected = kernel.engram_lookup(ids[0], head_dim=HEAD_DIM, table=table, out=out)
            cases = []
            for block_rows in (16, 128):
                committed = kernel.tile_config(placement, block_rows)
                cases.append((f"{block_rows} committed", committed))
                for split, prefetch in ((128, False), (128, True), (32, committed.prefetch)):
                    cases.append((f"{block_rows} split {split}{' prefetch' if prefetch else ''}",
                                  replace(committed, split_bytes=split, prefetch=prefetch)))
            for rnd in range(2):
                for name, config in cases:
                    equal, t = timed_launch(table, placement, config, ids, out, expected,
                                            budget_s)
                    found.append({"placement": placement, "round": rnd, "rows": num_rows,
                                  "out": out, "variant": name, "equal_to_committed": equal, **t,
                                  "GBps": moved_bytes(num_rows, out) / t["median_ms"] / 1e6,
                                  "read_GBps": num_rows * ROW_BYTES / t["median_ms"] / 1e6})
                    print(json.dumps(found[-1]), flush=True)
    return found


PEER_READS = [("256 B, sequential", 256, 256, 16, True), ("256 B", 256, 256, 16, False),
              ("264-B rows (packed Engram)", 264, 264, 8, False),
              ("264-B rows, loads cut at a sector boundary", 264, 264, 8, False),
              ("264-B rows, loads cut at a line boundary", 264, 264, 8, False),
              ("512 B", 512, 512, 16, False),
              ("4 KiB", 4096, 4096, 16, False)]


def peer_reads(gib: int, budget_s: float, num_ids: int) -> tuple[list[dict], float]:
    """GPU 0's SMs reading GPU 1's memory over NVLink (peer access), one chunk per id, against
    the copy engines' GPU1 -> GPU0 copy: what SM loads can pull over the link."""
    from lookup_timing import copy_ceilings
    ceiling = copy_ceilings()["p2p_GBps"]
    remote = torch.empty(gib * GIB, dtype=torch.uint8, device="cuda:1")
    remote.random_()
    out = torch.empty(num_ids, dtype=torch.int64, device="cuda:0")
    generator = torch.Generator(device="cuda:0").manual_seed(9)
    found = []
    for label, stride, chunk, align, sequential in PEER_READS:
        rows = remote.numel() // stride
        count = min(num_ids, rows)
        ids = [torch.arange(count, device="cuda:0") if sequential else
               torch.randint(0, rows, (count,), generator=generator, device="cuda:0")
               for k in range(4)]
        for per_sm in (4, 8, 16):
            t = timed(lambda i: gather_read(remote, ids[i % 4], out[:count], stride, chunk,
                                            align, 16, per_sm, split_of(label)), budget_s)
            rate = count * chunk / t["median_ms"] / 1e6
            found.append({"case": label, "programs_per_sm": per_sm, **t, "chunk_GBps": rate,
                          "pct_peer_copy": 100 * rate / ceiling})
            print(json.dumps(found[-1]), flush=True)
    return found, ceiling


FETCH_BYTES = (32, 64, 128)
FETCH_ROUNDS = 2


def l2_fetch(device: int, value: int | None = None) -> int:
    """Set (value given) and read back this process's L2 fetch granularity on `device`."""
    from cuda.bindings import runtime as cudart
    limit = cudart.cudaLimit.cudaLimitMaxL2FetchGranularity
    torch.cuda.synchronize()
    _, previous = cudart.cudaGetDevice()
    cudart.cudaSetDevice(device)
    try:
        if value is not None:
            (err,) = cudart.cudaDeviceSetLimit(limit, value)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaDeviceSetLimit(MaxL2FetchGranularity, {value}): {err}")
        _, found = cudart.cudaDeviceGetLimit(limit)
    finally:  # kernels launch on the thread's current device: leave it as it was
        cudart.cudaSetDevice(previous)
    return int(found)


def fetch_granularity(table: torch.Tensor, budget_s: float, peer_gib: int) -> tuple[list, dict]:
    """Lookups, 264-byte random reads (and half-remote peer lookups) under each granularity,
    rounds interleaved; outputs checked equal to the ones under the driver's default."""
    devices = list(range(min(2, torch.cuda.device_count()))) if peer_gib else [0]
    default = {d: l2_fetch(d) for d in devices}
    info = {"default_bytes": default}
    peer = None
    if peer_gib and len(devices) == 2:
        from lookup_timing import Table, copy_ceilings
        info["p2p_GBps"] = copy_ceilings()["p2p_GBps"]
        peer = Table("peer", peer_gib)
    generator = torch.Generator(device="cuda:0").manual_seed(13)
    cases = []
    for num_rows in LARGE_ROWS[-1:] + (1048576,):
        for name, source in (("hbm", table), ("peer", peer)):
            if source is None:
                continue
            rows = source.shape[0] if name == "hbm" else source.num_rows
            ids = lookup_id_sets(rows, num_rows, generator)
            for out in ("packed", "bf16"):
                cases.append((name, source, ids, out))
    flat = table.view(-1)
    gather_ids = [torch.randint(0, flat.numel() // ROW_BYTES, (LARGE_ROWS[1],),
                                generator=generator, device="cuda:0") for _ in range(4)]
    words = torch.empty(LARGE_ROWS[1], dtype=torch.int64, device="cuda:0")
    expected = {}
    for name, source, ids, out in cases:
        expected[(name, ids[0].numel(), out)] = lookup_of(name, source, ids[0], out)
    found = []
    for rnd in range(FETCH_ROUNDS):
        for value in (None,) + FETCH_BYTES:
            applied = {d: l2_fetch(d, default[d] if value is None else value) for d in devices}
            label = f"default ({applied[0]} B)" if value is None else f"{applied[0]} B"
            t = timed(lambda i: gather_read(flat, gather_ids[i % 4], words, ROW_BYTES,
                                            ROW_BYTES, 8), budget_s)
            found.append({"round": rnd, "fetch": label, "case": "random 264-B reads (hbm)",
                          **t, "GBps": LARGE_ROWS[1] * ROW_BYTES / t["median_ms"] / 1e6})
            print(json.dumps(found[-1]), flush=True)
            for name, source, ids, out in cases:
                num_rows = ids[0].numel()
                equal = torch.equal(lookup_of(name, source, ids[0], out).view(torch.uint8),
                                    expected[(name, num_rows, out)].view(torch.uint8))
                t = timed(lambda i: lookup_of(name, source, ids[i % len(ids)], out), budget_s)
                row = {"round": rnd, "fetch": label, "case": f"{name} lookup", "rows": num_rows,
                       "out": out, "equal_to_default": equal, **t,
                       "GBps": moved_bytes(num_rows, out) / t["median_ms"] / 1e6}
                if name == "peer":
                    row["remote_GBps"] = num_rows / 2 * ROW_BYTES / t["median_ms"] / 1e6
                found.append(row)
                print(json.dumps(found[-1]), flush=True)
    for d in devices:
        l2_fetch(d, default[d])
    return found, info


def lookup_of(name: str, source, ids: torch.Tensor, out: str) -> torch.Tensor:
    if name == "hbm":
        return kernel.engram_lookup(ids, head_dim=HEAD_DIM, table=source, out=out)
    return source.lookup(ids, out=out)


WINDOWS = [256 << 10, 2 << 20, 16 << 20, 128 << 20, 1 << 30, None]


def host_translation(gib: int, budget_s: float) -> tuple[list[dict], dict]:
    """Host lookups (16,392 rows, packed, ids unsorted) with ids inside a window of the table,
    small pages against transparent huge pages, 16- and 128-row tiles."""
    found, info = [], {}
    generator = torch.Generator(device="cuda:0").manual_seed(5)
    for placement in ("host", "host_thp"):
        rows = gib * GIB // ROW_BYTES
        memory = allocate_host_table(rows * ROW_BYTES, use_thp=placement == "host_thp")
        table = memory.view(rows, ROW_BYTES)
        info[placement] = {"huge_page_fraction": huge_page_bytes(memory) / memory.nbytes}
        table.view(-1)[:1 << 20].random_()
        for window in WINDOWS:
            window_rows = rows if window is None else window // ROW_BYTES
            start = int(torch.randint(0, rows - window_rows + 1, (1,), generator=generator,
                                      device="cuda:0"))
            ids = [start + torch.randint(0, window_rows, (683, NUM_COLS), generator=generator,
                                         device="cuda:0") for _ in range(4)]
            for block_rows in (16, 128):
                t = timed(lambda i: kernel.engram_lookup(
                    ids[i % 4], head_dim=HEAD_DIM, table=table, block_rows=block_rows,
                    sort_rows=False), budget_s)
                found.append({"placement": placement, "window_bytes": window or rows * ROW_BYTES,
                              "block_rows": block_rows, **t,
                              "read_GBps": ids[0].numel() * ROW_BYTES / t["median_ms"] / 1e6})
                print(json.dumps(found[-1]), flush=True)
        interleaved = []
        for num_tokens in (43, 171, 683):
            ids = [torch.randint(0, rows, (num_tokens, NUM_COLS), generator=generator,
                                 device="cuda:0") for _ in range(4)]
            times = {16: [], 128: []}
            for _ in range(10):
                for block_rows in (16, 128):
                    times[block_rows] += time_launches(lambda i: kernel.engram_lookup(
                        ids[i % 4], head_dim=HEAD_DIM, table=table, block_rows=block_rows),
                        budget_s=budget_s / 10, min_reps=10, max_reps=40)
            interleaved.append({"placement": placement, "rows": num_tokens * NUM_COLS,
                                **{f"r{b}": stats(t) for b, t in times.items()}})
            print(json.dumps(interleaved[-1]), flush=True)
        info[placement]["interleaved"] = interleaved
        del table, memory
    return found, info


def ncu_launches(gib: int, fetch: int | None) -> None:
    """One launch of each measured kind inside cudaProfilerStart/Stop (compiled before)."""
    if fetch is not None:
        print("L2 fetch granularity", l2_fetch(0, fetch), file=sys.stderr)
    table = torch.empty(gib * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8, device="cuda:0")
    fill_random(table, 3)
    flat = table.view(-1)
    generator = torch.Generator(device="cuda:0").manual_seed(1)
    ids = torch.randint(0, table.shape[0], (65536, NUM_COLS), generator=generator,
                        device="cuda:0")
    ids256 = torch.randint(0, flat.numel() // 256, (ids.numel(),), generator=generator,
                           device="cuda:0")
    seq = torch.arange(flat.numel() // 256 // 4, device="cuda:0")
    words = torch.empty(seq.numel(), dtype=torch.int64, device="cuda:0")

    def launches():
        kernel.engram_lookup(ids, head_dim=HEAD_DIM, table=table, out="packed")
        kernel.engram_lookup(ids, head_dim=HEAD_DIM, table=table, out="bf16")
        gather_read(flat, ids.view(-1), words, 264, 264, 8)
        gather_read(flat, ids256, words, 256, 256, 16)
        gather_read(flat, seq, words, 256, 256, 16)
    launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def environment() -> dict:
    """GPU 0, date, commit ($ENGRAM_COMMIT), torch and Triton of a report."""
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "num_sms": props.multi_processor_count,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("ENGRAM_COMMIT", "unknown"), "torch": torch.__version__,
            "triton": triton.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["hbm", "hints", "host"],
                        choices=["hbm", "hints", "host", "peer", "fetch", "split"])
    parser.add_argument("--hbm-gib", type=int, default=16)
    parser.add_argument("--host-gib", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=0.25)
    parser.add_argument("--ncu", action="store_true", help="launches for Nsight Compute only")
    parser.add_argument("--l2-fetch", type=int, choices=FETCH_BYTES,
                        help="with --ncu: L2 fetch granularity to set first")
    parser.add_argument("--peer-gib", type=int, default=8,
                        help="with --parts fetch on 2 GPUs: GiB of each peer slice")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    if args.ncu:
        ncu_launches(min(args.hbm_gib, 4), args.l2_fetch)
        return
    report = {"environment": environment()}
    report["sequential"] = sequential_ceilings(args.budget_s)
    print("sequential", report["sequential"], flush=True)
    if "split" in args.parts:
        table = torch.empty(args.hbm_gib * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8,
                            device="cuda:0")
        fill_random(table, 0)
        report["split"] = split_variants(table, "hbm", args.budget_s)
        del table
        torch.cuda.empty_cache()
        for placement in ("host", "host_thp"):
            rows = args.host_gib * GIB // ROW_BYTES
            memory = allocate_host_table(rows * ROW_BYTES, use_thp=placement == "host_thp")
            memory.view(-1)[:1 << 24].random_()
            report["split"] += split_variants(memory.view(rows, ROW_BYTES), placement,
                                              args.budget_s)
            del memory
    if {"hbm", "hints", "fetch"} & set(args.parts):
        table = torch.empty(args.hbm_gib * GIB // ROW_BYTES, ROW_BYTES, dtype=torch.uint8,
                            device="cuda:0")
        fill_random(table, 0)
        if "hbm" in args.parts:
            report["random_reads"] = random_reads(table.view(-1), args.budget_s, LARGE_ROWS[1])
        if "hints" in args.parts:
            report["lookup_variants"] = lookup_variants(table, args.budget_s)
        if "fetch" in args.parts:
            report["fetch"], report["fetch_info"] = fetch_granularity(table, args.budget_s,
                                                                      args.peer_gib)
        del table
        torch.cuda.empty_cache()
    if "peer" in args.parts:
        from engram_ray.kernels.lookup import enable_peer_access
        enable_peer_access(0, 1)
        report["peer_reads"], report["peer_copy_GBps"] = peer_reads(8, args.budget_s,
                                                                    LARGE_ROWS[1])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if "host" in args.parts:
        report["host_windows"], report["host_info"] = host_translation(args.host_gib,
                                                                       args.budget_s)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.md:
        args.md.write_text(markdown(report))


def markdown(report: dict) -> str:
    env, seq = report["environment"], report["sequential"]
    lines = [f"# What limits Engram lookups ({env['device']})", "",
             f"date {env['date']}, commit `{env['commit']}`, torch {env['torch']}, triton "
             f"{env['triton']}; 16 GiB HBM table of 264-byte rows; device events, L2 flushed "
             "before each launch, medians.", "",
             "Sequential (GB/s): " + ", ".join(f"{k[:-5]} {v:.0f}" for k, v in seq.items()), ""]
    if "random_reads" in report:
        lines += ["## Random reads, one chunk per id, 1,572,864 ids", "",
                  "sector GB/s = 32-byte sectors the chunks touch / time; % = of sequential read",
                  "", "| chunk | tile x programs/SM | median ms | chunk GB/s | sector GB/s | "
                  "% seq. read |", "|---|---|---|---|---|---|"]
        for r in report["random_reads"]:
            lines.append(f"| {r['case']} | {r['block_rows']}x{r['programs_per_sm']} | "
                         f"{r['median_ms']:.4f} | {r['chunk_GBps']:.0f} | "
                         f"{r['sector_GBps']:.0f} | "
                         f"{100 * r['sector_GBps'] / seq['read_GBps']:.0f}% |")
        lines.append("")
    if "lookup_variants" in report:
        lines += ["## Lookup launches and cache hints (HBM table)", "",
                  "GB/s = rows x (264 read + output written) / median; % = of the copy",
                  "", "| rows | out | launch | equal | median ms | p99 ms | GB/s | % copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in report["lookup_variants"]:
            lines.append(f"| {r['rows']} | {r['out']} | {r['variant']} | "
                         f"{r['equal_to_default']} | {r['median_ms']:.4f} | {r['p99_ms']:.4f} | "
                         f"{r['GBps']:.0f} | {100 * r['GBps'] / seq['copy_GBps']:.0f}% |")
        lines.append("")
    if "peer_reads" in report:
        lines += ["## GPU 0's SMs reading GPU 1's memory (NVLink), one chunk per id", "",
                  f"% = of the copy engines' GPU1 -> GPU0 copy, {report['peer_copy_GBps']:.0f} "
                  "GB/s", "", "| chunk | programs/SM | median ms | GB/s | % peer copy |",
                  "|---|---|---|---|---|"]
        for r in report["peer_reads"]:
            lines.append(f"| {r['case']} | {r['programs_per_sm']} | {r['median_ms']:.4f} | "
                         f"{r['chunk_GBps']:.0f} | {r['pct_peer_copy']:.0f}% |")
        lines.append("")
    if "split" in report:
        lines += ["## Row loads cut at a sector / line (TileConfig.split_bytes), HBM and host", "",
                  "GB/s = rows x (264 read + output written) / median; % = of the copy; read "
                  "GB/s = rows x 264 / median (host: over PCIe); 2 interleaved rounds", "",
                  "| placement | round | rows | out | launch | equal | median ms | p99 ms | GB/s "
                  "| % copy | read GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["split"]:
            lines.append(f"| {r['placement']} | {r['round']} | {r['rows']} | {r['out']} | "
                         f"{r['variant']} | {r['equal_to_committed']} | {r['median_ms']:.4f} | "
                         f"{r['p99_ms']:.4f} | {r['GBps']:.0f} | "
                         f"{100 * r['GBps'] / seq['copy_GBps']:.0f}% | {r['read_GBps']:.1f} |")
        lines.append("")
    if "fetch" in report:
        info = report["fetch_info"]
        lines += ["## L2 fetch granularity (cudaLimitMaxL2FetchGranularity)", "",
                  f"driver default: {info['default_bytes']}; GB/s = rows x (264 read + output "
                  "written) / median (lookups), 264 x ids / median (reads); remote GB/s = "
                  "half the rows x 264 / median"
                  + (f"; peer copy {info['p2p_GBps']:.0f} GB/s" if "p2p_GBps" in info else ""),
                  "", "| round | fetch | case | rows | out | equal | median ms | p99 ms | GB/s "
                  "| % copy | remote GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["fetch"]:
            remote = (f"{r['remote_GBps']:.0f} ({100 * r['remote_GBps'] / info['p2p_GBps']:.0f}%)"
                      if "remote_GBps" in r else "")
            lines.append(f"| {r['round']} | {r['fetch']} | {r['case']} | {r.get('rows', '')} | "
                         f"{r.get('out', '')} | {r.get('equal_to_default', '')} | "
                         f"{r['median_ms']:.4f} | {r['p99_ms']:.4f} | {r['GBps']:.0f} | "
                         f"{100 * r['GBps'] / seq['copy_GBps']:.0f}% | {remote} |")
        lines.append("")
    if "host_windows" in report:
        info = report["host_info"]
        lines += ["## Host tables: ids inside a window (16,392 rows, packed, unsorted)", "",
                  "huge-page fraction: " + ", ".join(f"{p} {i['huge_page_fraction']:.3f}"
                                                     for p, i in info.items()), "",
                  "| placement | window | tile | median ms | read GB/s |", "|---|---|---|---|---|"]
        for r in report["host_windows"]:
            lines.append(f"| {r['placement']} | {r['window_bytes'] / 2**20:.2f} MiB | "
                         f"{r['block_rows']} | {r['median_ms']:.4f} | {r['read_GBps']:.1f} |")
        lines += ["", "## Host tables: 16- vs 128-row tiles timed interleaved (10 rounds)", "",
                  "| placement | rows | r16 median / p99 ms | r128 median / p99 ms | r128/r16 |",
                  "|---|---|---|---|---|"]
        for placement, i in info.items():
            for r in i["interleaved"]:
                lines.append(f"| {placement} | {r['rows']} | {r['r16']['median_ms']:.4f} / "
                             f"{r['r16']['p99_ms']:.4f} | {r['r128']['median_ms']:.4f} / "
                             f"{r['r128']['p99_ms']:.4f} | "
                             f"{r['r128']['median_ms'] / r['r16']['median_ms']:.3f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
