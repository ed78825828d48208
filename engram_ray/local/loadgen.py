"""Requests against an OpenAI endpoint, each judged by what its client saw.

Used by the serving benchmarks and the slow serving and fault tests. A request is

    ok        a complete answer: non-streamed, HTTP 200 with a finish_reason in every choice;
              streamed, HTTP 200, a finish_reason, then `data: [DONE]`, and no error event
    failed    the client saw it fail: an HTTP error status, an error event, a broken
              connection or a timeout (the error text is kept)
    lost      the client saw no error and no complete answer (HTTP 200, the stream ended
              cleanly without finish_reason or [DONE]): lost silently, the fault that must
              never happen

Raw HTTP (httpx), not the `openai` SDK: the SDK hides whether a stream ended with [DONE].
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from engram_ray.serve.edge.fingerprint import fingerprint_parts

OK, FAILED, LOST = "ok", "failed", "lost"


@dataclass
class RequestResult:
    outcome: str                 # OK, FAILED or LOST (module docstring)
    chat: bool = False
    stream: bool = True
    started_at: float = 0.0      # time.monotonic() when sent
    ttft_s: float = 0.0
    total_s: float = 0.0
    num_chunks: int = 0
    status: int = 0
    generation: str | None = None  # the generation the ingress sent it to (its header)
    config: str | None = None      # the version of the engine settings that answered (header)
    text: str = ""
    error: str = ""
    retry_after: str | None = None  # the Retry-After header of an error response

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def ended_at(self) -> float:
        return self.started_at + self.total_s


@dataclass
class LoadReport:
    num_streams: int
    wall_s: float
    results: list = field(default_factory=list)

    @property
    def failures(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    @property
    def lost(self) -> list[RequestResult]:
        return [r for r in self.results if r.outcome == LOST]

    def percentiles(self, attr: str) -> dict[str, float]:
        values = sorted(getattr(r, attr) for r in self.results if r.ok)
        if not values:
            return {}
        pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": values[-1],
                "mean": statistics.fmean(values)}

    def summary(self) -> dict:
        return {"num_streams": self.num_streams, "num_failed": len(self.failures),
                "num_lost_silently": len(self.lost), "wall_s": round(self.wall_s, 2),
                "ttft_s": self.percentiles("ttft_s"), "total_s": self.percentiles("total_s"),
                "errors": sorted({r.error for r in self.failures})[:5]}


def request_body(model: str, prompt: str, max_tokens: int, chat: bool, stream: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stream": stream, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one_request(http, base_url: str, model: str, prompt: str, max_tokens: int,
                      chat: bool, stream: bool) -> RequestResult:
    """One request, judged (module docstring). `http`: an httpx.AsyncClient."""
    import httpx

    result = RequestResult(FAILED, chat, stream, time.monotonic())
    path = "/chat/completions" if chat else "/completions"
    try:
        async with http.stream("POST", base_url + path, json=request_body(
                model, prompt, max_tokens, chat, stream)) as resp:
            result.status = resp.status_code
            result.generation = resp.headers.get("x-engram-generation") or None
            result.config = resp.headers.get("x-engram-config") or None
            if resp.status_code != 200:
                result.retry_after = resp.headers.get("retry-after")
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            elif stream:
                await _read_stream(resp, result)
            else:
                _read_answer(json.loads(await resp.aread()), result)
    except (httpx.HTTPError, ValueError) as exc:  # broken connection, timeout, bad JSON
        result.outcome, result.error = FAILED, f"{type(exc).__name__}: {str(exc)[:200]}"
    result.total_s = time.monotonic() - result.started_at
    return result


async def _read_stream(resp, result: RequestResult) -> None:
    finished = done = False
    pieces = []
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            result.error = f"error event: {json.dumps(event['error'])[:200]}"
            return  # outcome stays FAILED: the client saw it
        result.num_chunks += 1
        if result.num_chunks == 1:
            result.ttft_s = time.monotonic() - result.started_at
        for choice in event.get("choices", ()):
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finished = finished or choice.get("finish_reason") is not None
    result.text = "".join(pieces)
    if finished and done:
        result.outcome = OK
    else:
        result.outcome = LOST
        result.error = f"stream ended cleanly without {'[DONE]' if finished else 'finish_reason'}"


def _read_answer(answer: dict, result: RequestResult) -> None:
    choices = answer.get("choices") or []
    result.generation = fingerprint_parts(answer.get("system_fingerprint"))[0] \
        or result.generation
    result.ttft_s = time.monotonic() - result.started_at
    result.num_chunks = 1
    result.text = "".join(c.get("text") or (c.get("message") or {}).get("content") or ""
                          for c in choices)
    if choices and all(c.get("finish_reason") is not None for c in choices):
        result.outcome = OK
    else:
        result.outcome, result.error = LOST, "HTTP 200 without a finished choice"


def _client(num_connections: int, timeout_s: float):
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    return httpx.AsyncClient(limits=httpx.Limits(max_connections=num_connections + 8),
                             timeout=timeout_s)


async def run_load_async(base_url: str, model: str, num_streams: int = 100,
                         max_tokens: int = 16, timeout_s: float = 120.0) -> LoadReport:
    """`num_streams` concurrent streams (half completions, half chat) within `timeout_s`."""
    async with _client(num_streams, timeout_s) as http:
        start = time.perf_counter()
        tasks = [one_request(http, base_url, model, f"Stream {i}: the river", max_tokens,
                             chat=i % 2 == 1, stream=True) for i in range(num_streams)]
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s)
        return LoadReport(num_streams, time.perf_counter() - start, list(results))


def run_load(base_url: str, model: str, **kwargs) -> LoadReport:
    return asyncio.run(run_load_async(base_url, model, **kwargs))


class Traffic:
    """`concurrency` clients sending requests one after another (streamed and not,
    completions and chat, in turn; a pause of `backoff_s` after a failure) from start()
    until stop(), in a thread of its own.

        traffic = Traffic(url, model, concurrency=8).start(); ...; results = traffic.stop()
    """

    def __init__(self, base_url: str, model: str, concurrency: int = 8, max_tokens: int = 24,
                 timeout_s: float = 120.0, prompt: str = "The river",
                 backoff_s: float = 0.5):
        self.base_url, self.model, self.prompt = base_url, model, prompt
        self.concurrency, self.max_tokens, self.timeout_s = concurrency, max_tokens, timeout_s
        self.backoff_s = backoff_s  # a client pauses this long after a failed request
        self.results: list[RequestResult] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def stop(self, wait_s: float | None = None) -> list[RequestResult]:
        """Stop sending; wait for requests in flight (up to the request timeout)."""
        self._stop.set()
        self._thread.join(wait_s if wait_s is not None else self.timeout_s + 10)
        return list(self.results)

    async def _run(self) -> None:
        turn = itertools.count()
        async with _client(self.concurrency, self.timeout_s) as http:
            async def client() -> None:
                while not self._stop.is_set():
                    i = next(turn)
                    result = await one_request(
                        http, self.base_url, self.model, self.prompt, self.max_tokens,
                        chat=i % 2 == 1, stream=i % 4 < 2)
                    self.results.append(result)
                    if not result.ok:
                        await asyncio.sleep(self.backoff_s)
            await asyncio.gather(*(client() for _ in range(self.concurrency)))


def probe_generations(base_url: str, model: str, stop, period_s: float = 0.2,
                      timeout_s: float = 60.0,
                      answers: list | None = None) -> list[tuple[float, str | None]]:
    """Small non-streamed completions one after another until `stop` (a threading.Event) is
    set: (monotonic time the answer came, its generation id from `system_fingerprint`, or None
    for a failed request), in answer order. Pass `answers` to watch them arrive from another
    thread (it is appended to and returned)."""
    import httpx

    answers = [] if answers is None else answers
    with httpx.Client(timeout=timeout_s) as http:
        while not stop.is_set():
            try:
                resp = http.post(f"{base_url}/completions", json={
                    "model": model, "prompt": "hi", "max_tokens": 2})
                fingerprint = resp.json().get("system_fingerprint") if resp.is_success else None
                fingerprint = fingerprint_parts(fingerprint)[0]
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
