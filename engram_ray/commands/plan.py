"""`engram-ray plan`: Engram table memory per GPU and per node for a placement."""

from __future__ import annotations

import json

from engram_ray.layout import load_layout
from engram_ray.plan import HOST_MODES, PLACEMENTS, MemoryPlan, gib, make_plan

HELP = "print the Engram table memory plan (HBM, host, peer-group split) for a model"


def configure(parser) -> None:
    parser.add_argument("--model", default="deepseek-v4.1-flash",
                        help="preset name or path to a config.json (default: deepseek-v4.1-flash)")
    parser.add_argument("--placement", default="peer", choices=PLACEMENTS,
                        help="hbm: whole tables per GPU; host: CPU offload; peer: split over P GPUs")
    parser.add_argument("--peer-group-size", type=int, default=8, help="P for --placement peer")
    parser.add_argument("--host-mode", default="per-engine", choices=HOST_MODES,
                        help="host copies: one per engine, heads split over DP, or one per node")
    parser.add_argument("--dp-size", type=int, default=2, help="D for --host-mode dp-split")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--compare", nargs="?", const="host:dp-split", metavar="PLACEMENT[:MODE]",
                        help="a second plan to show beside the first (default host:dp-split)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _plan(args, spec: str | None = None) -> MemoryPlan:
    placement, host_mode = args.placement, args.host_mode
    if spec:
        placement, _, mode = spec.partition(":")
        host_mode = mode or host_mode
    return make_plan(args.layout, placement, peer_group_size=args.peer_group_size,
                     host_mode=host_mode, dp_size=args.dp_size, gpus_per_node=args.gpus_per_node)


def run(args) -> int:
    args.layout = load_layout(args.model)
    plans = [_plan(args)] + ([_plan(args, args.compare)] if args.compare else [])
    if args.json:
        out = {"model": args.model, "layout": args.layout.to_dict(),
               "plans": [p.to_dict() for p in plans]}
        if len(plans) == 2:
            out["kv_gain_bytes_per_gpu"] = plans[0].kv_gain_vs(plans[1])
        print(json.dumps(out, indent=2))
    else:
        print(format_plans(args.model, args.layout, plans))
    return 0


def format_plans(model: str, layout, plans: list[MemoryPlan]) -> str:
    lines = [f"model {model}: {layout.num_layers} Engram tables, {layout.num_cols} columns "
             f"per layer, {layout.row_bytes}-byte rows, {gib(layout.total_bytes):.2f} GiB total"]
    for layer_id, rows, nbytes in zip(layout.layer_ids, layout.rows_per_table,
                                      layout.table_bytes):
        lines.append(f"  layer {layer_id:>3}: {rows:>13,} rows  {gib(nbytes):>8.2f} GiB")
    header = f"{'':<26}" + "".join(f"{p.placement:>18}" for p in plans)
    lines += ["", header, f"{'':<26}" + "".join(f"{p.description[:17]:>18}" for p in plans)]
    rows = [("HBM per GPU (GiB)", lambda p: gib(p.hbm_bytes_per_gpu)),
            ("host per GPU (GiB)", lambda p: gib(p.host_bytes_per_gpu)),
            ("host per node (GiB)", lambda p: gib(p.host_bytes_per_node))]
    for i, layer_id in enumerate(layout.layer_ids):
        rows.append((f"  layer {layer_id} HBM/GPU (GiB)",
                     lambda p, i=i: gib(p.hbm_bytes_per_gpu_by_table[i])))
    for label, value in rows:
        lines.append(f"{label:<26}" + "".join(f"{value(p):>18.2f}" for p in plans))
    for plan in plans:
        lines.append(f"  {plan.placement}: {plan.description}")
    if len(plans) == 2:
        gain = plans[0].kv_gain_vs(plans[1])
        lines.append(f"KV cache per GPU, {plans[0].placement} against {plans[1].placement}: "
                     f"{'+' if gain >= 0 else ''}{gib(gain):.2f} GiB")
    return "\n".join(lines)
