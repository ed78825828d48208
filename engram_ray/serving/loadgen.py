"""Concurrent streaming requests against an OpenAI endpoint, with per-request latencies.

Used by benchmarks/bench_serving.py and the slow serving tests. Each stream records time to
first token, total time and the number of chunks; a failed stream records its error text.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class StreamResult:
    ok: bool
    ttft_s: float = 0.0
    total_s: float = 0.0
    num_chunks: int = 0
    error: str = ""


@dataclass
class LoadReport:
    num_streams: int
    wall_s: float
    results: list = field(default_factory=list)

    @property
    def failures(self) -> list[StreamResult]:
        return [r for r in self.results if not r.ok]

    def percentiles(self, attr: str) -> dict[str, float]:
        values = sorted(getattr(r, attr) for r in self.results if r.ok)
        if not values:
            return {}
        pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": values[-1],
                "mean": statistics.fmean(values)}

    def summary(self) -> dict:
        return {"num_streams": self.num_streams, "num_failed": len(self.failures),
                "wall_s": round(self.wall_s, 2), "ttft_s": self.percentiles("ttft_s"),
                "total_s": self.percentiles("total_s"),
                "errors": sorted({r.error for r in self.failures})[:5]}


async def _one_stream(client, model: str, prompt: str, max_tokens: int,
                      chat: bool) -> StreamResult:
    start = time.perf_counter()
    ttft, num_chunks = None, 0
    try:
        if chat:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, stream=True)
        else:
            stream = await client.completions.create(model=model, prompt=prompt,
                                                     max_tokens=max_tokens, stream=True)
        async for _ in stream:
            num_chunks += 1
            ttft = ttft if ttft is not None else time.perf_counter() - start
        return StreamResult(True, ttft or 0.0, time.perf_counter() - start, num_chunks)
    except Exception as exc:  # the error text is the result
        return StreamResult(False, total_s=time.perf_counter() - start,
                            error=f"{type(exc).__name__}: {str(exc)[:200]}")


async def run_load_async(base_url: str, model: str, num_streams: int = 100,
                         max_tokens: int = 16, timeout_s: float = 120.0) -> LoadReport:
    """`num_streams` concurrent streams (half completions, half chat) within `timeout_s`."""
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=num_streams + 8)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as http:
        client = AsyncOpenAI(base_url=base_url, api_key="load", http_client=http,
                             max_retries=0)
        start = time.perf_counter()
        tasks = [_one_stream(client, model, f"Stream {i}: the river", max_tokens, i % 2 == 1)
                 for i in range(num_streams)]
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)
        return LoadReport(num_streams, time.perf_counter() - start, list(results))


def run_load(base_url: str, model: str, **kwargs) -> LoadReport:
    return asyncio.run(run_load_async(base_url, model, **kwargs))


def probe_generations(base_url: str, model: str, stop, period_s: float = 0.2,
                      timeout_s: float = 60.0) -> list[tuple[float, str | None]]:
    """Small non-streamed completions one after another until `stop` (a threading.Event) is
    set: (monotonic time the answer came, its generation id from `system_fingerprint`, or None
    for a failed request), in answer order."""
    import httpx

    answers = []
    with httpx.Client(timeout=timeout_s) as http:
        while not stop.is_set():
            try:
                resp = http.post(f"{base_url}/completions", json={
                    "model": model, "prompt": "hi", "max_tokens": 2})
                fingerprint = resp.json().get("system_fingerprint") if resp.is_success else None
            except (httpx.HTTPError, ValueError):
                fingerprint = None
            answers.append((time.monotonic(), fingerprint))
            stop.wait(period_s)
    return answers


def check_generation_order(answers: list[tuple[float, str | None]]) -> dict[str, list[str]]:
    """Per peer group (generation ids are `<deployment>-<group>.<n>.<token>`), its generations
    in the order they first answered; AssertionError if an older generation of a group answers
    after a newer one did (survivors must stop before the new generation serves)."""
    order: dict[str, list[str]] = {}
    for at, generation in answers:
        if generation is None:
            continue
        seen = order.setdefault(generation.rsplit(".", 2)[0], [])
        if generation not in seen:
            seen.append(generation)
        elif generation != seen[-1]:
            raise AssertionError(f"generation {generation} answered at {at:.1f} after "
                                 f"{seen[-1]} had answered: a mixed-generation window")
    return order
