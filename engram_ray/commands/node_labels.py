"""`engram-ray node-labels`: the `--labels` value of `ray start` for this node's NVLink domain."""

from __future__ import annotations

import json
import sys

from engram_ray.config import DEFAULT_DOMAIN_LABEL_KEY

HELP = "print this node's Ray labels (its NVLink domain) for `ray start --labels`"


def configure(parser) -> None:
    parser.add_argument("--label-key", default=DEFAULT_DOMAIN_LABEL_KEY,
                        help=f"label naming the NVLink domain (default {DEFAULT_DOMAIN_LABEL_KEY}; "
                             "must match the deployment's domain_label_key)")
    parser.add_argument("--json", action="store_true",
                        help="print the decision (domain, kind, reason, GPUs) as JSON")


def run(args) -> int:
    from engram_ray.topology import decide_domain, format_labels, probe_node

    decision = decide_domain(probe_node())
    labels = {args.label_key: decision.domain_id}
    if args.json:
        print(json.dumps({"labels": labels, "domain_id": decision.domain_id,
                          "kind": decision.kind, "num_gpus": decision.num_gpus,
                          "reason": decision.reason}, indent=2))
        return 0
    print(format_labels(labels))
    # stdout stays the bare value (for `ray start --labels "$(engram-ray node-labels)"`).
    print(f"[node-labels] {decision.kind}: {decision.reason}", file=sys.stderr)
    return 0
