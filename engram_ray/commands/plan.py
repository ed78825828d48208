"""`engram-ray plan`: Engram table memory per GPU and per node for a placement."""

from __future__ import annotations

import json

from engram_ray.model.layout import load_model_config
from engram_ray.planning.host_kv import (HOST_KV_RESERVE_GIB, HostKVBudget, KVTokenBytes,
                                         host_kv_budget, kv_bytes_per_token)
from engram_ray.planning.memory import HOST_MODES, PLACEMENTS, MemoryPlan, gib, make_plan

HELP = "print the Engram table memory plan (HBM, host, peer-group split) for a model"
LABEL_WIDTH = 30
MIN_COLUMN_WIDTH = 18


def configure(parser) -> None:
    parser.add_argument("--model", default="deepseek-v4.1-flash",
                        help="preset name or path to a config.json (or its folder)")
    parser.add_argument("--placement", default="peer", choices=PLACEMENTS,
                        help="hbm: whole tables per GPU; host: CPU offload; peer: split over P GPUs")
    parser.add_argument("--peer-group-size", type=int, default=8, metavar="P",
                        help="GPUs of one NVLink domain that split the rows (--placement peer)")
    parser.add_argument("--host-mode", default="per-engine", choices=HOST_MODES,
                        help="host copies: one per engine, heads split over DP, or one per node")
    parser.add_argument("--dp-size", type=int, default=2, metavar="D",
                        help="data-parallel ranks sharing the heads (--host-mode dp-split)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--compare", nargs="?", const="host:dp-split",
                        metavar="PLACEMENT[:MODE|:P]",
                        help="a second plan to show beside the first, and what the first frees "
                             "against it: host memory per GPU and per node, KV cache per GPU "
                             "(default when given without a value: host:dp-split; peer:4 is a "
                             "peer group of 4)")
    parser.add_argument("--host-reserve-gib", type=float, default=HOST_KV_RESERVE_GIB,
                        metavar="GIB", help="host memory per GPU kept back from the host KV "
                        "cache the split frees (serving.host_kv_reserve_gib; with --compare)")
    parser.add_argument("--kv-bytes-per-token", type=int, metavar="B",
                        help="KV-cache bytes of one token over all layers, for the tokens the "
                             "host KV cache holds (default: from the model's config.json when "
                             "it has the attention fields; the preset has only the Engram ones)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _plan(args, spec: str | None = None) -> MemoryPlan:
    placement, host_mode, group_size = args.placement, args.host_mode, args.peer_group_size
    if spec:
        placement, _, mode = spec.partition(":")
        if placement == "peer" and mode:
            group_size = _group_size(mode)
        else:
            host_mode = mode or host_mode
    return make_plan(args.layout, placement, peer_group_size=group_size,
                     host_mode=host_mode, dp_size=args.dp_size, gpus_per_node=args.gpus_per_node)


def _group_size(text: str) -> int:
    from engram_ray.errors import ConfigError

    if not text.isdigit():
        raise ConfigError("--compare", f"names peer group size {text!r}", "peer:P with P a "
                          "positive integer, e.g. peer:4")
    return int(text)


def _token_bytes(args, config: dict, source: str) -> KVTokenBytes | None:
    from engram_ray.errors import ConfigError

    if args.kv_bytes_per_token is None:
        return kv_bytes_per_token(config, source)
    if args.kv_bytes_per_token < 1:
        raise ConfigError("--kv-bytes-per-token", f"is {args.kv_bytes_per_token}",
                          "a positive number of bytes")
    return KVTokenBytes(args.kv_bytes_per_token, "--kv-bytes-per-token")


def run(args) -> int:
    from engram_ray.model.layout import EngramLayout

    config, source = load_model_config(args.model)
    args.layout = EngramLayout.from_config(config, source)
    plans = [_plan(args)] + ([_plan(args, args.compare)] if args.compare else [])
    if args.host_reserve_gib < 0:
        from engram_ray.errors import ConfigError
        raise ConfigError("--host-reserve-gib", f"is {args.host_reserve_gib:g}",
                          "a number of GiB >= 0")
    host_kv = (host_kv_budget(plans[0], plans[1], args.host_reserve_gib,
                              _token_bytes(args, config, source)) if args.compare else None)
    if args.json:
        out = {"model": args.model, "layout": args.layout.to_dict(),
               "plans": [p.to_dict() for p in plans]}
        if len(plans) == 2:
            out["kv_gain_bytes_per_gpu"] = plans[0].kv_gain_vs(plans[1])
            out["host_bytes_freed_per_gpu"], out["host_bytes_freed_per_node"] = (
                plans[0].host_freed_vs(plans[1]))
            out["host_kv_cache"] = host_kv.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(format_plans(args.model, args.layout, plans, args.gpus_per_node, host_kv=host_kv))
    return 0


def format_plans(model: str, layout, plans: list[MemoryPlan], gpus_per_node: int = 8, *,
                 host_kv: HostKVBudget | None = None) -> str:
    lines = [f"model {model}: {layout.num_layers} Engram tables, {layout.num_cols} columns "
             f"per layer, {layout.row_bytes}-byte rows, {gib(layout.total_bytes):.2f} GiB total"]
    for layer_id, rows, nbytes in zip(layout.layer_ids, layout.rows_per_table,
                                      layout.table_bytes):
        lines.append(f"  layer {layer_id:>3}: {rows:>13,} rows  {gib(nbytes):>8.2f} GiB")
    width = max(MIN_COLUMN_WIDTH, *(len(p.label) + 2 for p in plans))
    lines += ["", f"{'':<{LABEL_WIDTH}}" + "".join(f"{p.label:>{width}}" for p in plans)]
    rows = [("HBM per GPU (GiB)", lambda p: gib(p.hbm_bytes_per_gpu)),
            ("host per GPU (GiB)", lambda p: gib(p.host_bytes_per_gpu)),
            (f"host per node (GiB, {gpus_per_node} GPUs)", lambda p: gib(p.host_bytes_per_node))]
    for i, layer_id in enumerate(layout.layer_ids):
        rows.append((f"  layer {layer_id} HBM/GPU (GiB)",
                     lambda p, i=i: gib(p.hbm_bytes_per_gpu_by_table[i])))
    for label, value in rows:
        lines.append(f"{label:<{LABEL_WIDTH}}" + "".join(f"{value(p):>{width}.2f}" for p in plans))
    lines += [f"  {plan.label}: {plan.description}" for plan in plans]
    if len(plans) == 2:
        lines += ["", *format_comparison(plans[0], plans[1], gpus_per_node)]
    if host_kv is not None:
        lines += format_host_kv(model, host_kv)
    return "\n".join(lines)


def format_comparison(plan: MemoryPlan, other: MemoryPlan, gpus_per_node: int) -> list[str]:
    """What `plan` frees and costs against `other`, in words: no bare signed numbers."""
    per_gpu, per_node = plan.host_freed_vs(other)
    kv_gain = plan.kv_gain_vs(other)
    if per_gpu > 0 or per_node > 0:
        host = (f"{gib(per_gpu):.2f} GiB freed per GPU, {gib(per_node):.2f} GiB freed per node "
                f"of {gpus_per_node} GPUs")
    elif per_gpu < 0 or per_node < 0:
        host = (f"{gib(-per_gpu):.2f} GiB more needed per GPU, {gib(-per_node):.2f} GiB more "
                f"per node of {gpus_per_node} GPUs")
    else:
        host = "the same"
    if kv_gain > 0:
        kv = f"{gib(kv_gain):.2f} GiB more per GPU (its tables take that much less HBM)"
    elif kv_gain < 0:
        kv = f"{gib(-kv_gain):.2f} GiB less per GPU (its tables take that much more HBM)"
    else:
        kv = "the same"
    return [f"{plan.label} against {other.label}:",
            f"  host memory:     {host}",
            f"  KV cache (HBM):  {kv}"]


def format_host_kv(model: str, budget: HostKVBudget) -> list[str]:
    """The host KV cache the freed host memory buys (vLLM's CPU KV-cache offloading)."""
    pad = " " * 19
    if budget.freed_bytes_per_gpu <= 0:
        return ["  host KV cache:   none: no host memory freed (serving.host_kv_cache_gib is "
                "refused)"]
    lines = [f"  host KV cache:   {gib(budget.cache_bytes_per_gpu):.2f} GiB per GPU "
             f"({gib(budget.freed_bytes_per_gpu):.2f} GiB freed - "
             f"{gib(budget.reserve_bytes_per_gpu):.2f} GiB reserve) for vLLM's",
             f"{pad}CPU KV-cache offloading (serving.host_kv_cache_gib: auto)"]
    token = budget.token_bytes
    if token is None:
        lines += [f"{pad}tokens it holds: not known: {model} has no attention fields (a",
                  f"{pad}preset has the Engram fields only); give --kv-bytes-per-token B",
                  f"{pad}or --model <checkpoint>/config.json"]
    else:
        lines += [f"{pad}= {budget.tokens_per_gpu:,} tokens of KV cache per GPU at "
                  f"{token.num_bytes:,} bytes per token",
                  f"{pad}({token.source})"]
    return lines
