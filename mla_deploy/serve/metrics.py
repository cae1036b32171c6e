"""GET /metrics: the engine's and scheduler's counters in Prometheus' text exposition format (version 0.0.4)."""

from __future__ import annotations

from ..runtime.engine import Histogram


def render_metrics(service) -> str:
    engine, scheduler = service.engine, service.engine.scheduler
    stats = scheduler.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
        lines.append(f"# HELP mla_{name} {help_}")
        lines.append(f"# TYPE mla_{name} {kind}")
        lines.extend(f"mla_{name}{labels} {value:g}" for labels, value in samples)

    def by_status(counts: dict[int, int]) -> list[tuple[str, float]]:
        return [(f'{{status="{s}"}}', n) for s, n in sorted(counts.items())] or [("", 0)]

    metric("requests_total", "counter", "Requests answered, by HTTP status.", by_status(service.status_counts))
    metric("streams_failed_total", "counter", "Streamed requests (answered 200) that ended with an error event, by "
           "the error's status.", by_status(service.stream_errors))
    metric("requests_finished_total", "counter", "Generations finished, by reason.",
           [(f'{{reason="{r}"}}', n) for r, n in sorted(stats.finished.items())])
    metric("requests_rejected_total", "counter", "Requests refused because the queue was full.",
           [("", engine.stats.rejected)])
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", stats.prefill_tokens)])
    metric("prompt_tokens_cached_total", "counter",
           "Prompt tokens found in a cache row (prefix caching), not prefilled.", [("", stats.cached_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", stats.generated_tokens)])
    metric("queue_depth", "gauge", "Requests waiting for a cache row.", [("", engine.queue_depth)])
    metric("running_requests", "gauge", "Requests holding a cache row.", [("", len(scheduler.running))])
    metric("max_batch", "gauge", "Cache rows.", [("", scheduler.max_batch)])
    metric("decode_steps_total", "counter", "Batched decode calls.", [("", stats.decode_steps)])
    metric("decode_rows_total", "counter",
           "Rows that produced a token, summed over decode calls (divided by decode_steps_total: batch occupancy).",
           [("", stats.decoded_rows)])
    spec, drafts = scheduler.speculation, stats.speculation
    metric("speculation_info", "gauge", "The scheduler's speculative decoding: its mode (off, lookup, mtp) and the "
           "most draft tokens a row proposes per step.",
           [(f'{{mode="{spec.mode}",draft_tokens="{spec.draft_tokens if spec.on else 0}"}}', 1)])
    metric("spec_decode_verify_steps_total", "counter", "Verification passes (steps where a row proposed drafts).",
           [("", drafts.verify_steps)])
    metric("spec_decode_draft_tokens_total", "counter", "Draft tokens proposed.", [("", drafts.proposed)])
    metric("spec_decode_accepted_tokens_total", "counter",
           "Draft tokens accepted (divided by spec_decode_draft_tokens_total: the acceptance rate).",
           [("", drafts.accepted)])
    _histogram(lines, "time_to_first_token_seconds", "From submission to the first token.", engine.stats.ttft)
    _histogram(lines, "inter_token_latency_seconds", "Between consecutive tokens of one request.",
               engine.stats.inter_token)
    return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_: str, h: Histogram) -> None:
    lines.append(f"# HELP mla_{name} {help_}")
    lines.append(f"# TYPE mla_{name} histogram")
    for bound, count in zip(h.BOUNDS, h.counts):
        lines.append(f'mla_{name}_bucket{{le="{bound:g}"}} {count}')
    lines.append(f'mla_{name}_bucket{{le="+Inf"}} {h.count}')
    lines.append(f"mla_{name}_sum {h.sum:g}")
    lines.append(f"mla_{name}_count {h.count}")
