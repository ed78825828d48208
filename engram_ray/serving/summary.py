"""A few lines summarising engines' live `/metrics` (used by `engram-ray local`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

MIB, GIB = 1 << 20, 1 << 30


def parse_samples(text: str) -> dict[str, list]:
    """Sample name -> [(labels, value)] of one /metrics text."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _sum(samples, name, **match) -> float:
    return sum(v for labels, v in samples.get(name, [])
               if all(labels.get(k) == want for k, want in match.items()))


def engine_row(samples: dict) -> dict:
    steps = _sum(samples, "engram_engine_step_seconds_count")
    step_sum = _sum(samples, "engram_engine_step_seconds_sum")
    engine = next((labels["engine"] for labels, _ in samples.get("engram_group_healthy", [])),
                  "?")
    return {"engine": engine,
            "table_mib": _sum(samples, "engram_table_bytes") / MIB,
            "host_mib": _sum(samples, "engram_host_bytes") / MIB,
            "kv_gib": _sum(samples, "engram_kv_cache_capacity_bytes") / GIB,
            "kv_tokens": int(_sum(samples, "engram_kv_cache_capacity_tokens")),
            "kv_usage": _sum(samples, "engram_kv_cache_usage_ratio"),
            "headroom_gib": _sum(samples, "engram_kv_cache_headroom_bytes") / GIB,
            "gain_mib": _sum(samples, "engram_kv_cache_gain_bytes") / MIB,
            "steps": int(steps), "step_ms": 1000 * step_sum / steps if steps else 0.0,
            "generation": int(_sum(samples, "engram_group_generation")),
            "healthy": _sum(samples, "engram_group_healthy") == 1,
            "requests_ok": int(_sum(samples, "vllm:request_success_total"))}


def format_summary(texts: dict[str, str]) -> str:
    """One line per engine endpoint (`texts`: target -> /metrics text)."""
    header = (f"{'engine':<12}{'tables':>10}{'host':>10}{'KV cap':>10}{'KV tokens':>11}"
              f"{'KV used':>9}{'headroom':>10}{'gain':>10}{'steps':>7}{'step':>9}{'gen':>5}"
              f"{'healthy':>9}{'req ok':>8}")
    lines = [header]
    for target, text in sorted(texts.items()):
        r = engine_row(parse_samples(text))
        lines.append(f"{r['engine']:<12}{r['table_mib']:>7.2f}MiB{r['host_mib']:>7.2f}MiB"
                     f"{r['kv_gib']:>7.2f}GiB{r['kv_tokens']:>11,}{100 * r['kv_usage']:>8.1f}%"
                     f"{r['headroom_gib']:>7.2f}GiB{r['gain_mib']:>7.2f}MiB{r['steps']:>7}"
                     f"{r['step_ms']:>7.1f}ms{r['generation']:>5}{str(r['healthy']):>9}"
                     f"{r['requests_ok']:>8}")
    return "\n".join(lines)
