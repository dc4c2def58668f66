"""Prometheus text-format metrics, collected only when ``metrics_enabled`` is on.

Counters live in memory and start from zero at every server start. No metric carries
a prompt, a reply, a model name or a path: routes are labelled by their template.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from .engines import vram_of

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 5, 10, 20, 40, 80, 160, 320)

_TYPED_PARAM = re.compile(r"\{([^}:]+):[^}]+\}")


def route_label(template: str) -> str:
    return _TYPED_PARAM.sub(r"{\1}", template) or "other"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        lab = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{lab} {self.sum}")
        out.append(f"{name}_count{lab} {self.count}")
        return out


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.durations: dict[tuple[str, str], Histogram] = {}
        self.in_flight = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tps = Histogram(TPS_BUCKETS)
        self.queue_depth = 0
        self.slots_active = 0
        self.slots = 0
        self.models_loaded = 0
        self.vram: tuple[int, int] | None = None

    def observe_request(self, method: str, template: str, status: int, seconds: float) -> None:
        route = route_label(template)
        self.requests[(method, route, status)] += 1
        hist = self.durations.get((method, route))
        if hist is None:
            hist = self.durations[(method, route)] = Histogram(DURATION_BUCKETS)
        hist.observe(seconds)

    def observe_generation(self, *, prompt_tokens: int, generated_tokens: int, ttft: float | None,
                           tokens_per_sec: float | None) -> None:
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        if ttft is not None:
            self.ttft.observe(ttft)
        if tokens_per_sec is not None:
            self.tps.observe(tokens_per_sec)

    def observe_engines(self, engines: list[Any]) -> None:
        """The inference gauges from the loaded models' engines: their slots, the requests
        decoding in them and the requests waiting for one; the accelerator memory, when an
        engine reads it (no reading: no VRAM gauges)."""
        slots = active = waiting = 0
        self.vram = next((found for found in map(vram_of, engines) if found is not None), None)
        if self.vram is not None:  # (used, total)
            self.vram = (self.vram[1] - self.vram[0], self.vram[1])
        for engine in engines:
            n = int(getattr(engine, "slots", 1) or 1)
            busy = int(getattr(engine, "busy", 0) or 0)
            running = min(int(getattr(engine, "active", min(busy, n))), n, busy)
            slots, active, waiting = slots + n, active + running, waiting + max(0, busy - running)
        self.slots, self.slots_active, self.queue_depth = slots, active, waiting

    def render(self) -> str:
        out: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        head("localm_http_requests_total", "counter", "HTTP requests by method, route template and status")
        for (method, route, status), n in sorted(self.requests.items()):
            out.append(f'localm_http_requests_total{{method="{_esc(method)}",route="{_esc(route)}",'
                       f'status="{status}"}} {n}')
        head("localm_http_request_duration_seconds", "histogram", "HTTP request duration")
        for (method, route), hist in sorted(self.durations.items()):
            out.extend(hist.lines("localm_http_request_duration_seconds",
                                  f'method="{_esc(method)}",route="{_esc(route)}"'))
        head("localm_http_requests_in_flight", "gauge", "HTTP requests being served")
        out.append(f"localm_http_requests_in_flight {self.in_flight}")
        head("localm_prompt_tokens_total", "counter", "Prompt tokens processed")
        out.append(f"localm_prompt_tokens_total {self.prompt_tokens}")
        head("localm_generated_tokens_total", "counter", "Tokens generated")
        out.append(f"localm_generated_tokens_total {self.generated_tokens}")
        head("localm_time_to_first_token_seconds", "histogram", "Time to first token")
        out.extend(self.ttft.lines("localm_time_to_first_token_seconds", ""))
        head("localm_tokens_per_second", "histogram", "Generation speed per reply")
        out.extend(self.tps.lines("localm_tokens_per_second", ""))
        head("localm_inference_queue_depth", "gauge", "Requests waiting for a loaded model's inference slot")
        out.append(f"localm_inference_queue_depth {self.queue_depth}")
        head("localm_inference_slots_active", "gauge", "Requests decoding now, over every loaded model")
        out.append(f"localm_inference_slots_active {self.slots_active}")
        head("localm_inference_slots", "gauge", "Requests the loaded models can decode at once")
        out.append(f"localm_inference_slots {self.slots}")
        head("localm_models_loaded", "gauge", "Models resident in memory")
        out.append(f"localm_models_loaded {self.models_loaded}")
        if self.vram is not None:
            head("localm_vram_used_bytes", "gauge", "GPU memory in use")
            out.append(f"localm_vram_used_bytes {self.vram[0]}")
            head("localm_vram_total_bytes", "gauge", "GPU memory in total")
            out.append(f"localm_vram_total_bytes {self.vram[1]}")
        return "\n".join(out) + "\n"
