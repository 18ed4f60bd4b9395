"""Prometheus text metrics, folded from engine events (the engine thread calls `observe`)."""

from __future__ import annotations

import threading
from collections import Counter

from mtplx.events import DraftVerified, EngineEvent, Failed, Finished, FirstToken, Restored

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, layout: dict | None = None):
        self.layout = layout  # a sharded run's layout (mode, ranks), shown as a gauge
        self.lock = threading.Lock()
        self.requests = Counter()  # (route, status)
        self.finished = Counter()  # finish reason
        self.failed = 0
        self.restored_tokens = 0
        self.prompt_tokens = 0
        self.ceiling_tokens = 0
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.drafted = Counter()
        self.accepted = Counter()
        # how turns shared the engine (engine/stats.py): rounds alone and batched, the rows of
        # the batched ones, the wait for admission and for other requests' work between rounds
        self.rounds = Counter()  # batched: True / False
        self.batch_rows = 0
        self.queued_s = 0.0
        self.others_s = 0.0

    def request(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[(route, status)] += 1

    def observe(self, event: EngineEvent) -> None:
        with self.lock:
            if isinstance(event, Restored):
                self.restored_tokens += event.cached_tokens
                self.prompt_tokens += event.prompt_tokens
                self.ceiling_tokens += event.ceiling or 0
            elif isinstance(event, FirstToken):
                self.ttft_sum += event.ttft_s
                self.ttft[next((i for i, b in enumerate(TTFT_BUCKETS) if event.ttft_s <= b), len(TTFT_BUCKETS))] += 1
            elif isinstance(event, DraftVerified):
                for position in range(1, event.drafted + 1):
                    self.drafted[position] += 1
                    self.accepted[position] += position <= event.accepted
            elif isinstance(event, Finished):
                self.finished[event.finish_reason] += 1
                s = event.stats
                self.rounds[True] += s.batched_rounds
                self.rounds[False] += s.rounds - s.batched_rounds
                self.batch_rows += s.batch_rows
                self.queued_s += s.queued_s
                self.others_s += s.others_s
            elif isinstance(event, Failed):
                self.failed += 1

    def render(self) -> str:
        with self.lock:
            lines = ["# TYPE mtplx_requests_total counter"]
            lines += [f'mtplx_requests_total{{route="{r}",status="{s}"}} {n}' for (r, s), n in sorted(self.requests.items())]
            lines += ["# TYPE mtplx_generations_total counter"]
            lines += [f'mtplx_generations_total{{finish="{k}"}} {n}' for k, n in sorted(self.finished.items())]
            lines += ["# TYPE mtplx_generation_failures_total counter", f"mtplx_generation_failures_total {self.failed}",
                      "# TYPE mtplx_prompt_tokens_total counter", f"mtplx_prompt_tokens_total {self.prompt_tokens}",
                      "# TYPE mtplx_cache_restored_tokens_total counter", f"mtplx_cache_restored_tokens_total {self.restored_tokens}",
                      "# TYPE mtplx_cache_ceiling_tokens_total counter", f"mtplx_cache_ceiling_tokens_total {self.ceiling_tokens}",
                      "# TYPE mtplx_ttft_seconds histogram"]
            total = 0
            for bound, n in zip((*TTFT_BUCKETS, "+Inf"), self.ttft):
                total += n
                lines.append(f'mtplx_ttft_seconds_bucket{{le="{bound}"}} {total}')
            lines += [f"mtplx_ttft_seconds_sum {self.ttft_sum:.6f}", f"mtplx_ttft_seconds_count {total}",
                      "# TYPE mtplx_drafts_total counter"]
            lines += [f'mtplx_drafts_total{{position="{p}"}} {n}' for p, n in sorted(self.drafted.items())]
            lines += ["# TYPE mtplx_drafts_accepted_total counter"]
            lines += [f'mtplx_drafts_accepted_total{{position="{p}"}} {n}' for p, n in sorted(self.accepted.items())]
            lines += ["# TYPE mtplx_decode_rounds_total counter"]
            lines += [f'mtplx_decode_rounds_total{{batched="{str(b).lower()}"}} {self.rounds[b]}' for b in (False, True)]
            lines += ["# TYPE mtplx_batched_round_rows_total counter", f"mtplx_batched_round_rows_total {self.batch_rows}",
                      "# TYPE mtplx_queued_seconds_total counter", f"mtplx_queued_seconds_total {self.queued_s:.6f}",
                      "# TYPE mtplx_waited_on_others_seconds_total counter",
                      f"mtplx_waited_on_others_seconds_total {self.others_s:.6f}"]
            if self.layout:
                lines += ["# TYPE mtplx_ranks gauge", f'mtplx_ranks{{mode="{self.layout["mode"]}"}} {self.layout["ranks"]}']
            return "\n".join(lines) + "\n"
