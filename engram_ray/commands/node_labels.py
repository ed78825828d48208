"""`engram-ray node-labels`: this node's Ray labels (its NVLink domain) for `ray start`.

Three ways out, one decision (`engram_ray.planning.topology.decide_domain`):

    ray start ... --labels "$(engram-ray node-labels)"                 # k=v on stdout
    engram-ray node-labels --labels-file /etc/ray/labels.yaml          # KubeRay init container,
    ray start ... --labels-file=/etc/ray/labels.yaml                   # then the Ray container
    engram-ray node-labels --json                                      # the decision and why
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from engram_ray.config import DEFAULT_DOMAIN_LABEL_KEY

HELP = "print this node's Ray labels (its NVLink domain) for `ray start --labels`"


def configure(parser) -> None:
    parser.add_argument("--label-key", default=DEFAULT_DOMAIN_LABEL_KEY,
                        help="label naming the NVLink domain (must match the deployment's "
                             "domain_label_key)")
    parser.add_argument("--json", action="store_true",
                        help="print the decision (domain, kind, reason, GPUs) as JSON")
    parser.add_argument("--labels-file", metavar="PATH",
                        help="also write the labels to PATH as the YAML mapping `ray start "
                             "--labels-file` reads (e.g. from a Kubernetes init container)")


def run(args) -> int:
    from engram_ray.planning.topology import decide_domain, format_labels, probe_node

    decision = decide_domain(probe_node())
    labels = {args.label_key: decision.domain_id}
    if args.labels_file:
        write_labels_file(args.labels_file, labels)
    if args.json:
        print(json.dumps({"labels": labels, "domain_id": decision.domain_id,
                          "kind": decision.kind, "num_gpus": decision.num_gpus,
                          "reason": decision.reason}, indent=2))
        return 0
    print(format_labels(labels))
    # stdout stays the bare value (for `ray start --labels "$(engram-ray node-labels)"`).
    print(f"[node-labels] {decision.kind}: {decision.reason}", file=sys.stderr)
    return 0


def write_labels_file(path: str, labels: dict[str, str]) -> None:
    """`labels` as a YAML mapping of strings, written atomically (a reader never sees half)."""
    import yaml

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".labels.", suffix=".yaml")
    with os.fdopen(fd, "w") as out:
        # Quoted: a value like `none` or `1` must stay a string for Ray's label parser.
        yaml.safe_dump({str(k): str(v) for k, v in labels.items()}, out,
                       default_style='"', default_flow_style=False)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
