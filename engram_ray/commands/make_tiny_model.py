"""`engram-ray make-tiny-model DIR`: write the tiny Engram model that vLLM serves on CPU."""

from __future__ import annotations

import json

HELP = "write a tiny Engram model (config, local tokenizer, seeded weights) that vLLM serves on CPU"


def configure(parser) -> None:
    parser.add_argument("model_dir", metavar="DIR", help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--num-experts", type=int, default=0, metavar="N",
                        help="experts per MLP (vLLM's MixtralMoE; default 0: dense). vLLM forms "
                             "a data-parallel group only for MoE models: give experts to try "
                             "serving.data_parallel_size > 1")


def run(args) -> int:
    from engram_ray.model.layout import EngramLayout
    from engram_ray.vllm.tiny_checkpoint import TinyModelSpec, write_tiny_model

    model_dir = write_tiny_model(args.model_dir, TinyModelSpec(seed=args.seed,
                                                               num_experts=args.num_experts))
    config = json.loads((model_dir / "config.json").read_text())
    layout = EngramLayout.from_config(config)
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    experts = f", {args.num_experts} experts per MLP" if args.num_experts else ""
    print(f"wrote {model_dir}: {config['architectures'][0]}{experts}, {size / 2**20:.1f} MiB, "
          "Engram tables "
          f"{list(layout.rows_per_table)} rows x {layout.row_bytes} B at layers "
          f"{list(layout.layer_ids)}")
    return 0
