"""`EngramStatLogger`: a vLLM aggregate stat logger feeding a replica's engine metrics
(`engram_ray.metrics.engine.EngineMetrics`): KV-cache usage and engine step time."""

from __future__ import annotations

from engram_ray.metrics.engine import EngineMetrics


class EngramStatLogger:
    """A vLLM aggregate stat logger: KV-cache usage and engine step time into `EngineMetrics`.

    Step time = the interval between consecutive engine outputs while requests run (vLLM
    reports once per engine step)."""

    def __init__(self, metrics: EngineMetrics, capacity_bytes: int, capacity_tokens: int):
        self.metrics = metrics
        self.capacity_bytes, self.capacity_tokens = capacity_bytes, capacity_tokens
        self._last_step_at: float | None = None

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            self.metrics.set_kv_cache(self.capacity_bytes, self.capacity_tokens,
                                      scheduler_stats.kv_cache_usage)
            if scheduler_stats.num_running_reqs == 0:
                self._last_step_at = None
        if iteration_stats is not None:
            now = iteration_stats.iteration_timestamp
            if self._last_step_at is not None:
                self.metrics.observe_step(max(0.0, now - self._last_step_at))
            self._last_step_at = now

    def record_sleep_state(self, *args, **kwargs):
        pass

    def record_admission_rejection(self, *args, **kwargs):
        pass

    def log(self):
        pass

    def log_engine_initialized(self):
        pass
