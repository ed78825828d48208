"""Filling this rank's slice of a table: from the deterministic generator or a checkpoint.

Both write in chunks, so host memory stays bounded at one chunk whatever the slice size, and
report progress on stderr for slices of `PROGRESS_MIN_BYTES` or more.

Checkpoint tensors of a table (safetensors, one file or a folder of shards):
`<prefix>.weight` FP8 e4m3 `[rows, head_dim]` and `<prefix>.scale` (DeepSeek's name) or
`<prefix>.weight_scale_inv` (vLLM's) ue8m0 `[rows, head_dim // 32]` (float8_e8m0fnu or uint8; raw bytes either way), where the prefix ends
in `layers.<layer id>.engram.embed`. Only this rank's rows are read (`safe_open(...).get_slice`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import torch

from engram_ray.errors import ConfigError
from engram_ray.model.reference import pack_rows
from engram_ray.model.synthetic import fill_synthetic

PROGRESS_MIN_BYTES = 1 << 30
SYNTHETIC_CHUNK_ROWS = 1 << 20    # ~2 GiB of int64 temporaries per step on a GPU
CHECKPOINT_CHUNK_ROWS = 1 << 18   # 66 MiB of host memory at 264-byte rows


class _Progress:
    """Prints `label: done/total GiB (pct%)` at most every 10% for large slices."""

    def __init__(self, label: str, total_bytes: int):
        self.label, self.total = label, total_bytes
        self.is_on = total_bytes >= PROGRESS_MIN_BYTES
        self.next_pct, self.start = 10, time.perf_counter()

    def update(self, done_bytes: int) -> None:
        pct = 100 * done_bytes // max(1, self.total)
        if self.is_on and pct >= self.next_pct:
            print(f"[engram-ray] fill {self.label}: {done_bytes / 2**30:.1f}/"
                  f"{self.total / 2**30:.1f} GiB ({pct}%, {time.perf_counter() - self.start:.1f}"
                  " s)", file=sys.stderr, flush=True)
            self.next_pct = pct // 10 * 10 + 10


def fill_synthetic_slice(owned: torch.Tensor, first_row: int, head_dim: int, seed: int,
                         label: str, chunk_rows: int = SYNTHETIC_CHUNK_ROWS) -> None:
    """`owned` `[rows, row_bytes]` <- synthetic rows `first_row ...` (on `owned.device`)."""
    progress = _Progress(label, owned.numel())
    fill_synthetic(owned, first_row, head_dim, seed, chunk_rows,
                   on_chunk=lambda rows_done: progress.update(rows_done * owned.shape[1]))
    if owned.is_cuda:
        torch.cuda.synchronize(owned.device)
        torch.cuda.empty_cache()  # the generator's temporaries: give them back for KV cache


# DeepSeek-V4.1 checkpoints name the scales `...engram.embed.scale`; vLLM renames them to
# `weight_scale_inv` on load, and checkpoints written by vLLM-side tools keep that name.
SCALE_SUFFIXES = ("scale", "weight_scale_inv")
# safetensors dtype names: FP8 e4m3 values; ue8m0 scales as float8_e8m0fnu or raw uint8.
VALUE_DTYPES = ("F8_E4M3", "U8")
SCALE_DTYPES = ("F8_E8M0", "U8")


def find_table_tensors(checkpoint: str, layer_id: int):
    """((file, name) of the values, (file, name) of the scales) of layer `layer_id`'s table."""
    suffix = f"layers.{layer_id}.engram.embed.weight"
    located = {name: path for path, names in _checkpoint_names(checkpoint) for name in names}
    for name, path in located.items():
        if name == suffix or name.endswith("." + suffix):
            prefix = name[:-len(".weight")]
            for scale_suffix in SCALE_SUFFIXES:
                scale_name = f"{prefix}.{scale_suffix}"
                if scale_name in located:
                    return (path, name), (located[scale_name], scale_name)
            raise ConfigError("checkpoint", f"{checkpoint} has {name} but no scales for it",
                              f"{prefix}.scale or {prefix}.weight_scale_inv")
    raise ConfigError("checkpoint", f"{checkpoint} has no tensor named '*{suffix}'",
                      f"the Engram table of layer {layer_id} (…{suffix} and its "
                      "…scale or …weight_scale_inv)")


def parse_table_tensor(name: str) -> tuple[int, str]:
    """(layer id, "weight" | "weight_scale_inv") of a checkpoint table tensor name."""
    match = re.search(r"layers\.(\d+)\.engram\.embed\.(weight|weight_scale_inv)$", name)
    if match is None:
        raise ValueError(f"{name!r} is not an Engram table tensor "
                         "(expected '...layers.<id>.engram.embed.weight[_scale_inv]')")
    return int(match.group(1)), match.group(2)


def _checkpoint_names(checkpoint: str):
    from safetensors import safe_open
    if os.path.isfile(checkpoint):
        with safe_open(checkpoint, framework="pt") as f:
            yield checkpoint, list(f.keys())
        return
    if not os.path.isdir(checkpoint):
        raise ConfigError("checkpoint", f"{checkpoint!r} does not exist",
                          "a .safetensors file or a folder of them")
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            yield os.path.join(checkpoint, file), names
        return
    for file in sorted(os.listdir(checkpoint)):
        if file.endswith(".safetensors"):
            yield from _checkpoint_names(os.path.join(checkpoint, file))


def fill_from_checkpoint(owned: torch.Tensor, checkpoint: str, layer_id: int, first_row: int,
                         num_rows: int, head_dim: int,
                         chunk_rows: int = CHECKPOINT_CHUNK_ROWS) -> None:
    """`owned` `[rows, row_bytes]` <- checkpoint rows `[first_row, first_row + rows)`, read
    `chunk_rows` at a time (values and scales as raw bytes)."""
    from safetensors import safe_open
    (values_path, values_name), (scales_path, scales_name) = find_table_tensors(checkpoint,
                                                                               layer_id)
    with safe_open(values_path, framework="pt") as vf, safe_open(scales_path, framework="pt") as sf:
        values, scales = vf.get_slice(values_name), sf.get_slice(scales_name)
        expected = ([num_rows, head_dim], [num_rows, head_dim // 32])
        if [list(values.get_shape()), list(scales.get_shape())] != list(expected):
            raise ConfigError(f"checkpoint {values_path}: {values_name}",
                              f"has shapes {values.get_shape()} and {scales.get_shape()}",
                              f"{list(expected[0])} and {list(expected[1])} from the layout")
        for name, tensor, dtypes in ((values_name, values, VALUE_DTYPES),
                                     (scales_name, scales, SCALE_DTYPES)):
            if tensor.get_dtype() not in dtypes:  # raw bytes are copied: the width must be 1
                raise ConfigError(f"checkpoint {values_path}: {name}",
                                  f"has dtype {tensor.get_dtype()}", f"one of {dtypes}")
        progress = _Progress(f"layer {layer_id} from {os.path.basename(values_path)}", owned.numel())
        for begin in range(0, owned.shape[0], chunk_rows):
            end = min(owned.shape[0], begin + chunk_rows)
            rows = slice(first_row + begin, first_row + end)
            owned[begin:end].copy_(pack_rows(values[rows], scales[rows]))
            progress.update(end * owned.shape[1])
