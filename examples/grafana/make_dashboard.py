"""Write examples/grafana/stoker.json: a Grafana dashboard over vLLM's metric names and Stoker's
wall gauges. Run `python examples/grafana/make_dashboard.py` after changing a panel; a test
checks the JSON is this script's output and that the server exports every metric it queries.

Import it in Grafana (Dashboards -> New -> Import), pick the Prometheus data source that
scrapes `stoker serve`'s /metrics, and choose the model in the `model_name` variable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("stoker.json")
M = 'model_name="$model_name"'
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by(le) (rate({metric}_bucket{{{M}}}[$__rate_interval])))", f"P{int(q * 100)}")
            for q in (0.5, 0.9, 0.99)]


# (title, unit, [(PromQL, legend)], width): rows of the dashboard, top to bottom.
PANELS: list[tuple[str, str, list[tuple[str, str]], int]] = [
    # --- the wall (Stoker)
    ("Steps by wall (per second)", "ops", [
        (f"sum by(kind, wall) (rate(stoker:step_bound_total{{{M}}}[$__rate_interval]))", "{{kind}}: {{wall}}")], 12),
    ("Measured / predicted step time", "none", [
        (f"stoker:step_time_over_prediction{{{M}}}", "{{kind}} (last steps)"),
        (f"sum by(kind) (rate(stoker:step_seconds_total{{{M}}}[$__rate_interval])) / "
         f"sum by(kind) (rate(stoker:step_predicted_seconds_total{{{M}}}[$__rate_interval]))", "{{kind}} (rate)")], 12),
    ("MBU: share of peak memory bandwidth", "percentunit", [(f"stoker:mbu{{{M}}}", "{{kind}}")], 12),
    ("MFU: share of peak FLOP/s", "percentunit", [(f"stoker:mfu{{{M}}}", "{{kind}}")], 12),
    ("Achieved bandwidth vs the ceiling", "Bps", [
        (f"stoker:achieved_bytes_per_second{{{M}}}", "{{kind}}"),
        (f"stoker:ceiling_bytes_per_second{{{M}}}", "ceiling")], 12),
    ("Achieved FLOP/s vs the ceiling", "flops", [
        (f"stoker:achieved_flops_per_second{{{M}}}", "{{kind}}"),
        (f"stoker:ceiling_flops_per_second{{{M}}}", "ceiling")], 12),
    # --- vLLM's panels, on vLLM's names
    ("E2E request latency", "s", _quantiles("vllm:e2e_request_latency_seconds"), 12),
    ("Time to first token", "s", _quantiles("vllm:time_to_first_token_seconds"), 12),
    ("Inter-token latency", "s", _quantiles("vllm:inter_token_latency_seconds"), 12),
    ("Token throughput", "short", [
        (f"rate(vllm:prompt_tokens_total{{{M}}}[$__rate_interval])", "prompt tokens/s"),
        (f"rate(vllm:generation_tokens_total{{{M}}}[$__rate_interval])", "generation tokens/s")], 12),
    ("Scheduler state", "short", [
        (f"vllm:num_requests_running{{{M}}}", "running"), (f"vllm:num_requests_waiting{{{M}}}", "waiting")], 12),
    ("KV-cache usage", "percentunit", [(f"vllm:kv_cache_usage_perc{{{M}}}", "KV usage")], 12),
    ("Prefix-cache hit rate", "percentunit", [
        (f"rate(vllm:prefix_cache_hits_total{{{M}}}[$__rate_interval]) / "
         f"rate(vllm:prefix_cache_queries_total{{{M}}}[$__rate_interval])", "hit rate")], 12),
    ("Finished requests by reason", "reqps", [
        (f"sum by(finished_reason) (rate(vllm:request_success_total{{{M}}}[$__rate_interval]))", "{{finished_reason}}")], 12),
    ("Queue, prefill and decode time (P90)", "s", [
        (f"histogram_quantile(0.9, sum by(le) (rate(vllm:request_queue_time_seconds_bucket{{{M}}}[$__rate_interval])))", "queue"),
        (f"histogram_quantile(0.9, sum by(le) (rate(vllm:request_prefill_time_seconds_bucket{{{M}}}[$__rate_interval])))", "prefill"),
        (f"histogram_quantile(0.9, sum by(le) (rate(vllm:request_decode_time_seconds_bucket{{{M}}}[$__rate_interval])))", "decode")], 12),
    ("Tokens per engine step (P50, P90)", "short", [
        (f"histogram_quantile({q}, sum by(le) (rate(vllm:iteration_tokens_total_bucket{{{M}}}[$__rate_interval])))", f"P{int(q * 100)}")
        for q in (0.5, 0.9)], 12),
    ("Request lengths (P50)", "short", [
        (f"histogram_quantile(0.5, sum by(le) (rate(vllm:request_prompt_tokens_bucket{{{M}}}[$__rate_interval])))", "prompt"),
        (f"histogram_quantile(0.5, sum by(le) (rate(vllm:request_generation_tokens_bucket{{{M}}}[$__rate_interval])))", "generation")], 12),
    ("Preemptions", "short", [(f"rate(vllm:num_preemptions_total{{{M}}}[$__rate_interval])", "preemptions/s")], 12),
]


def dashboard() -> dict[str, Any]:
    panels = []
    x = y = 0
    for i, (title, unit, targets, width) in enumerate(PANELS):
        if x + width > 24:
            x, y = 0, y + 8
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "datasource": DS,
            "gridPos": {"h": 8, "w": width, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DS, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)],
        })
        x += width
    return {
        "title": "Stoker: the wall and the serving metrics",
        "uid": "stoker-wall",
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "tags": ["stoker", "vllm", "llm-serving"],
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "type": "datasource", "query": "prometheus", "label": "data source"},
            {"name": "model_name", "type": "query", "datasource": DS, "label": "model",
             "query": "label_values(vllm:num_requests_running, model_name)", "refresh": 2},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT} ({len(PANELS)} panels)")
