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
    rows_read = _sum(samples, "engram_rows_read_total")
    return {"engine": engine_of(samples),
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
            "reattached": _sum(samples, "engram_slices_reattached") == 1,
            "restarts": int(_sum(samples, "engram_engine_restarts_total")),
            "requests_ok": int(_sum(samples, "vllm:request_success_total")),
            "lookups": int(_sum(samples, "engram_lookup_seconds_count")),
            "remote_fraction": (_sum(samples, "engram_rows_read_total", rows="remote")
                                / rows_read if rows_read else 0.0)}


def engine_of(samples: dict) -> str:
    """The `engine` label of an endpoint's engram series ("?" if it has none)."""
    return next((labels["engine"] for series in samples.values() for labels, _ in series
                 if "engine" in labels), "?")


def merge_by_engine(texts: dict[str, str]) -> dict[str, dict]:
    """Engine -> samples of all its endpoints (the replica's and its model process's). An
    endpoint with no labelled series yet (a model process before its first lookup) is left out."""
    merged: dict[str, dict] = {}
    for _, text in sorted(texts.items()):
        samples = parse_samples(text)
        engine = engine_of(samples)
        if engine == "?":
            continue
        into = merged.setdefault(engine, {})
        for name, series in samples.items():
            into.setdefault(name, []).extend(series)
    return merged


def format_summary(texts: dict[str, str]) -> str:
    """One line per engine (`texts`: target -> /metrics text; an engine's endpoints merged)."""
    header = (f"{'engine':<12}{'tables':>10}{'host':>10}{'KV cap':>10}{'KV tokens':>11}"
              f"{'KV used':>9}{'headroom':>10}{'gain':>10}{'steps':>7}{'step':>9}{'gen':>5}"
              f"{'healthy':>9}{'req ok':>8}{'lookups':>9}{'remote':>8}")
    lines = [header]
    for _, samples in sorted(merge_by_engine(texts).items()):
        r = engine_row(samples)
        lines.append(f"{r['engine']:<12}{r['table_mib']:>7.2f}MiB{r['host_mib']:>7.2f}MiB"
                     f"{r['kv_gib']:>7.2f}GiB{r['kv_tokens']:>11,}{100 * r['kv_usage']:>8.1f}%"
                     f"{r['headroom_gib']:>7.2f}GiB{r['gain_mib']:>7.2f}MiB{r['steps']:>7}"
                     f"{r['step_ms']:>7.1f}ms{r['generation']:>5}{str(r['healthy']):>9}"
                     f"{r['requests_ok']:>8}{r['lookups']:>9}"
                     f"{100 * r['remote_fraction']:>7.1f}%")
    return "\n".join(lines)
