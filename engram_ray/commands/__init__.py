"""CLI subcommands. Each module has `HELP`, `configure(parser)` and `run(args) -> int`.

Modules are imported only when their command runs, so `engram-ray plan` never loads torch or Ray.
"""

# name -> module under engram_ray.commands
COMMANDS = {
    "plan": "plan",
    "make-tiny-model": "make_tiny_model",
    "doctor": "doctor",
    "node-labels": "node_labels",
    "local": "local",
    "probe": "probe",
    "dashboards": "dashboards",
    "check": "check",
    "status": "status",
    "config": "config",
}
