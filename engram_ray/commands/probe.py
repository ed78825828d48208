"""`engram-ray probe`: send the table of malformed requests to a local endpoint and check that
every one gets a short, clean 4xx (`engram_ray.local.probes`).

    engram-ray probe --url http://127.0.0.1:8000 --model engram-tiny
    engram-ray probe --json          # one result per probe, and the summary

Exit code 0 when every probe got its 4xx with a clean body, 1 otherwise. Loopback only.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from engram_ray.errors import ConfigError

HELP = "send malformed requests to a local OpenAI endpoint; check each gets a clean 4xx"


def configure(parser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="endpoint (loopback only), without /v1")
    parser.add_argument("--model", default="engram-tiny", help="model id the endpoint serves")
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")


def run(args) -> int:
    from engram_ray.local.probes import probe_summary, run_probes

    try:
        results = run_probes(args.url, args.model)
    except ValueError as exc:
        raise ConfigError("--url", str(exc), "http://127.0.0.1:PORT") from None
    summary = probe_summary(results)
    if args.json:
        print(json.dumps({"results": [asdict(r) | {"ok": r.ok} for r in results],
                          "summary": summary}, indent=2))
    else:
        for r in results:
            mark = "[ ok ]" if r.ok else "[FAIL]"
            got = r.status if r.status is not None else r.transport_error
            leak = f", body leaks {', '.join(r.leaks)}" if r.leaks else ""
            print(f"{mark} {r.name}: {got} (expected {r.expected_status}), "
                  f"{r.body_size} bytes{leak}: {r.message[:100]}")
        print(f"{summary['malformed_ok']} of {summary['malformed_probes']} probes got a clean "
              f"4xx; {summary['tracebacks_in_bodies']} bodies held a traceback")
    return 0 if summary["malformed_ok"] == summary["malformed_probes"] else 1
