"""`engram-ray local`: the local deployment (tiny Engram model, two CPU engines, one peer group).

Sets up the tiny model, starts Ray on 127.0.0.1, deploys cluster_configs/serve_local_tiny.yaml,
sends a completion through the OpenAI client, prints the memory plan, the endpoint and live
metrics, then serves until Ctrl-C or SIGTERM (`--once`: stop after the check); either way it
stops Serve and Ray and removes what it made.
"""

from __future__ import annotations

import signal
import time

HELP = "run the local deployment (tiny model, 2 CPU engines in one peer group) on 127.0.0.1"


def configure(parser) -> None:
    parser.add_argument("--workdir", default="/tmp/engram-ray",
                        help="tiny model, stores and targets list (default /tmp/engram-ray)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1")
    parser.add_argument("--once", action="store_true",
                        help="stop after the check (for scripts and tests)")
    parser.add_argument("--prompt", default="The river", help="prompt of the check")
    parser.add_argument("--prometheus-port", type=int, default=0, metavar="PORT",
                        help="also run Prometheus on 127.0.0.1:PORT with dashboards/prometheus.yml "
                             "(needs the `prometheus` binary; default: off)")
    parser.add_argument("--summary-every", type=float, default=60.0, metavar="S",
                        help="seconds between metric summaries while serving (default 60)")


def _plan_text(deployment) -> str:
    """DeepSeek-V4.1-Flash's plan (what the split is for) and the tiny group's actual split."""
    from engram_ray.commands.plan import format_plans
    from engram_ray.model.layout import load_layout
    from engram_ray.planning.memory import make_plan

    flash = load_layout("deepseek-v4.1-flash")
    text = format_plans("deepseek-v4.1-flash", flash, [
        make_plan(flash, "peer", peer_group_size=8),
        make_plan(flash, "host", host_mode="dp-split", dp_size=2)])
    tiny = load_layout(deployment.config.deployment.model)
    size = deployment.config.deployment.peer_group_size
    split = make_plan(tiny, "peer", peer_group_size=size)
    return (text + f"\nthis deployment (tiny model): {tiny.total_bytes / 2**20:.2f} MiB of tables, "
            f"{split.hbm_bytes_per_gpu / 2**20:.2f} MiB per engine in a peer group of {size} "
            f"(shared memory)")


def run(args) -> int:
    from engram_ray.local.deployment import LocalDeployment, LocalOptions, log

    # Ctrl-C / `kill -INT` stop it cleanly even when started from a shell that ignores SIGINT
    # (background jobs, nohup), whose SIG_IGN Python would otherwise keep.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    deployment = LocalDeployment(LocalOptions(workdir=args.workdir, port=args.port))
    try:
        deployment.start()
        # `kill`, systemd, docker stop: stop cleanly too. Set after Ray starts: its driver
        # installs a SIGTERM handler that aborts the process.
        signal.signal(signal.SIGTERM, _interrupt)
        log("waiting for the engines (vLLM on CPU; a few minutes on 2 cores)")
        seconds = deployment.wait_ready()
        log(f"ready after {seconds:.0f} s")
        text = deployment.complete(args.prompt)
        print(f"completion of {args.prompt!r}: {text!r}")
        print("\nmemory plan of the Engram tables:")
        print(_plan_text(deployment))
        print(f"\nendpoint: {deployment.url}/v1  (model {deployment.model_id!r}; OpenAI API: "
              "completions, chat completions, streaming)")
        print(f"ray:      {deployment.ray_address}  (RAY_AUTH_MODE=disabled)")
        print(f"targets:  {deployment.config.serving.prometheus_targets_file}  (Prometheus "
              "file_sd list of the engines' metrics endpoints)")
        ready_at = time.time()
        print("\nlive metrics:\n" + deployment.status_text(), flush=True)
        if args.prometheus_port:
            prometheus = deployment.start_prometheus(args.prometheus_port)
            print(f"prometheus: {prometheus.url}  (scrapes every engine; queries of "
                  "dashboards/*.json work there)", flush=True)
        if args.once:
            return 0
        log("serving; Ctrl-C (or SIGTERM) stops everything")
        while True:
            time.sleep(args.summary_every)
            # Deaths since the last block; the deployment carries on while Serve restarts
            # the engine (only a death before ready stops it: wait_ready).
            block, ready_at = deployment.status_text(since=ready_at), time.time()
            print("\nlive metrics:\n" + block, flush=True)
    finally:
        deployment.stop()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
