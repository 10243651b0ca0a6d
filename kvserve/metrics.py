"""Serving metrics with vLLM's Prometheus names, and the periodic one-line stats log.

Both are fed by the engine thread after every step (prometheus_client is thread-safe); the HTTP server only
renders them. Outputs must be DELTA outputs: each carries only the tokens new since the last one.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.core.scheduler_stats import SchedulerStats, SpecDecodingStats
from kvserve.outputs import PoolingRequestOutput, RequestOutput, completions

logger = logging.getLogger("kvserve.stats")

# vLLM's buckets, so dashboards built for vLLM read the same
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]


@dataclass
class IntervalCounts:
    """Token and prefix-cache counts since the last stats log line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    kv_transfer_loaded: int = 0
    kv_transfer_saved: int = 0
    kv_transfer_seconds: float = 0.0


class RecentWindow:
    """The last few minutes of time to first token, inter-token latency and generated tokens (the dashboard's
    charts; Prometheus keeps the whole history in its histograms)."""

    KEEP_S = 300.0

    def __init__(self):
        self.ttft: deque[tuple[float, float]] = deque(maxlen=100_000)
        self.itl: deque[tuple[float, float]] = deque(maxlen=100_000)
        self.tokens: deque[tuple[float, int]] = deque(maxlen=100_000)

    def summary(self, now: float, window_s: float = 60.0, rate_window_s: float = 10.0) -> dict:
        """p50/p90 of TTFT and ITL (ms) over the last window_s seconds, tokens/s over the last rate_window_s."""
        for series in (self.ttft, self.itl, self.tokens):
            while series and series[0][0] < now - self.KEEP_S:
                series.popleft()
        out = {}
        for name, series in (("ttft", self.ttft), ("itl", self.itl)):
            values = sorted(v for t, v in series if t >= now - window_s)
            for q in (50, 90):
                out[f"{name}_p{q}_ms"] = round(values[min(len(values) - 1, len(values) * q // 100)] * 1000, 2) \
                    if values else None
        out["tokens_per_s"] = round(sum(n for t, n in self.tokens if t >= now - rate_window_s) / rate_window_s, 1)
        return out


class EngineMetrics:
    """The vllm:* metrics of one served model, in their own registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        prometheus_client.disable_created_metrics()   # vLLM exposes no *_created series
        self.registry = registry or CollectorRegistry()
        self.recent = RecentWindow()
        self.model_name = model_name
        self.num_running = self._gauge("vllm:num_requests_running", "Requests in the running batch")
        self.num_waiting = self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Tokens generated")
        self.preemptions = self._counter("vllm:num_preemptions", "Preemptions of running requests (recompute, or swap into the host KV tier)")
        self.prefix_queries = self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.tier_saved = self._counter("kvserve:kv_offload_saved_blocks",
                                        "KV blocks evicted from the pool and kept in the host tier")
        self.tier_loaded = self._counter("kvserve:kv_offload_loaded_blocks",
                                         "KV blocks loaded back from the host tier instead of recomputed")
        self.transfer_saved = self._counter("kvserve:kv_transfer_saved_blocks",
                                            "KV blocks of computed prompts saved to the KV connector's store")
        self.transfer_loaded = self._counter("kvserve:kv_transfer_loaded_blocks",
                                             "KV blocks loaded from the KV connector's store instead of computed")
        self.transfer_seconds = self._counter("kvserve:kv_transfer_seconds",
                                              "Seconds spent saving and loading KV blocks through the KV connector")
        self.prompt_tokens_cached = self._counter("vllm:prompt_tokens_cached",
                                                  "Prompt tokens of finished prefills served from the prefix cache")
        self.spec_drafts = self._counter("vllm:spec_decode_num_drafts", "Speculative decoding: draft runs verified")
        self.spec_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens",
                                               "Speculative decoding: draft tokens verified")
        self.spec_accepted_tokens = self._counter("vllm:spec_decode_num_accepted_tokens",
                                                  "Speculative decoding: draft tokens accepted")
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Speculative decoding: draft tokens accepted, by position in the draft",
                                             ["model_name", "position"], registry=self.registry)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", _REQUEST_BUCKETS)
        self.queue_time = self._histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled",
                                          _REQUEST_BUCKETS)
        self.lora_info = Gauge("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests (the "
                               "value is when they last changed)", ["max_lora", "waiting_lora_adapters",
                                                                    "running_lora_adapters"], registry=self.registry)
        self._lora_names = None   # adapter ids -> names, with max_loras (enable_lora)
        self._lora_labels: tuple | None = None
        self.interval = IntervalCounts()
        self._last_token_time: dict[str, float] = {}
        self._last_stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: list[float]):
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return prometheus_client.generate_latest(self.registry)

    def enable_lora(self, max_loras: int, names: Callable[[set[int]], list[str]]) -> None:
        """Export vllm:lora_requests_info; `names` turns adapter ids into their names."""
        self._lora_names = (max_loras, names)
        self._update_lora(set(), set())

    def _update_lora(self, running: set[int], waiting: set[int]) -> None:
        max_loras, names = self._lora_names
        labels = (str(max_loras), ",".join(names(waiting)), ",".join(names(running)))
        if labels != self._lora_labels:   # one series, the current one (vLLM's reading of it)
            self.lora_info.clear()
            self.lora_info.labels(*labels).set_to_current_time()
            self._lora_labels = labels

    def update_scheduler(self, stats: SchedulerStats) -> None:
        """Gauges from the scheduler; its cumulative counts become counter increments."""
        if self._lora_names is not None:
            self._update_lora(stats.running_lora_ids, stats.waiting_lora_ids)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        self.preemptions.inc(max(stats.num_preemptions - last.num_preemptions, 0))
        queries = max(stats.prefix_cache_queries - last.prefix_cache_queries, 0)
        hits = max(stats.prefix_cache_hits - last.prefix_cache_hits, 0)
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.tier_saved.inc(max(stats.kv_tier_saved_blocks - last.kv_tier_saved_blocks, 0))
        self.tier_loaded.inc(max(stats.kv_tier_loaded_blocks - last.kv_tier_loaded_blocks, 0))
        saved = max(stats.kv_transfer_saved_blocks - last.kv_transfer_saved_blocks, 0)
        loaded = max(stats.kv_transfer_loaded_blocks - last.kv_transfer_loaded_blocks, 0)
        seconds = max(stats.kv_transfer_seconds - last.kv_transfer_seconds, 0)
        self.transfer_saved.inc(saved)
        self.transfer_loaded.inc(loaded)
        self.transfer_seconds.inc(seconds)
        self.interval.kv_transfer_saved += saved
        self.interval.kv_transfer_loaded += loaded
        self.interval.kv_transfer_seconds += seconds
        self.interval.prefix_queries += queries
        self.interval.prefix_hits += hits
        self._update_spec_decoding(last.spec_decoding, stats.spec_decoding)
        self._last_stats = stats

    def _update_spec_decoding(self, last: SpecDecodingStats, now: SpecDecodingStats) -> None:
        drafts = max(now.num_drafts - last.num_drafts, 0)
        if not drafts:
            return
        draft_tokens = max(now.num_draft_tokens - last.num_draft_tokens, 0)
        accepted = max(now.num_accepted_tokens - last.num_accepted_tokens, 0)
        self.spec_drafts.inc(drafts)
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted_tokens.inc(accepted)
        for pos, count in enumerate(now.num_accepted_per_pos):
            before = last.num_accepted_per_pos[pos] if pos < len(last.num_accepted_per_pos) else 0
            self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(max(count - before, 0))
        self.interval.spec_drafts += drafts
        self.interval.spec_draft_tokens += draft_tokens
        self.interval.spec_accepted_tokens += accepted

    def record_outputs(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        """Token counts and latencies of one step's DELTA outputs."""
        now = time.monotonic() if now is None else now
        for out in outputs:
            num_new = sum(len(o.token_ids) for o in completions(out))
            if num_new:
                self._record_tokens(out, num_new, now)
            if out.finished:
                self._record_finished(out, now)

    def _record_tokens(self, out: RequestOutput, num_new: int, now: float) -> None:
        last = self._last_token_time.get(out.request_id)
        if last is None:
            arrival = out.metrics.get("arrival_time")
            if arrival is not None:
                self.ttft.observe(max(now - arrival, 0.0))
                self.recent.ttft.append((now, max(now - arrival, 0.0)))
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prompt_tokens_cached.inc(out.num_cached_tokens)
            self.interval.prompt_tokens += len(out.prompt_token_ids)
        else:
            self.itl.observe(max(now - last, 0.0))
            self.recent.itl.append((now, max(now - last, 0.0)))
        self._last_token_time[out.request_id] = now
        self.recent.tokens.append((now, num_new))
        self.generation_tokens.inc(num_new)
        self.interval.generation_tokens += num_new

    def _record_finished(self, out: RequestOutput, now: float) -> None:
        self._last_token_time.pop(out.request_id, None)
        if isinstance(out, PoolingRequestOutput):   # no token: its prompt is counted as it finishes
            self.request_success.labels(self.model_name, "stop" if out.outputs.data is not None else "abort").inc()
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prompt_tokens_cached.inc(out.num_cached_tokens)
            self.interval.prompt_tokens += len(out.prompt_token_ids)
        for o in completions(out):
            self.request_success.labels(self.model_name, o.finish_reason or "abort").inc()
        arrival = out.metrics.get("arrival_time")
        if arrival is None:
            return
        self.e2e.observe(max(now - arrival, 0.0))
        scheduled = out.metrics.get("first_scheduled_time")
        if scheduled is not None:
            self.queue_time.observe(max(scheduled - arrival, 0.0))

    def take_interval(self) -> IntervalCounts:
        counts, self.interval = self.interval, IntervalCounts()
        return counts


class StatLogger:
    """Logs one line of throughput, queue and cache figures every `interval_s` while the server is busy."""

    def __init__(self, metrics: EngineMetrics, interval_s: float = 10.0):
        self.metrics = metrics
        self.interval_s = interval_s
        self._last_time = time.monotonic()

    def maybe_log(self, stats: SchedulerStats, now: float | None = None) -> bool:
        """Log if the interval is over and anything happened in it; True when a line was written."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return False
        counts = self.metrics.take_interval()
        self._last_time = now
        busy = (stats.num_running or stats.num_waiting or counts.prompt_tokens or counts.generation_tokens
                or counts.spec_drafts)
        if not busy:
            return False
        fields = {"prompt_throughput": round(counts.prompt_tokens / elapsed, 1),
                  "generation_throughput": round(counts.generation_tokens / elapsed, 1),
                  "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                  "kv_cache_usage": round(stats.kv_cache_usage * 100, 1),
                  "prefix_cache_hit_rate": round(100 * counts.prefix_hits / max(counts.prefix_queries, 1), 1)}
        message = ("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                   "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%")
        if counts.spec_drafts:
            # vLLM's definitions: accepted / proposed drafts, and tokens emitted per verification (1 + accepted)
            fields["spec_acceptance_rate"] = round(100 * counts.spec_accepted_tokens / counts.spec_draft_tokens, 1)
            fields["spec_mean_acceptance_length"] = round(1 + counts.spec_accepted_tokens / counts.spec_drafts, 2)
            message += ", Draft acceptance rate: %.1f%%, Mean acceptance length: %.2f"
        if counts.kv_transfer_saved or counts.kv_transfer_loaded:
            fields["kv_transfer_loaded_blocks"] = counts.kv_transfer_loaded
            fields["kv_transfer_saved_blocks"] = counts.kv_transfer_saved
            fields["kv_transfer_seconds"] = round(counts.kv_transfer_seconds, 3)
            message += ", KV transfer: %d blocks loaded, %d saved in %.3f s"
        logger.info(message, *fields.values(), extra=fields)
        return True
