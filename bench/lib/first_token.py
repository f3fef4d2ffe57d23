"""Where a first token's time goes: a run's mean TTFT in parts, from the client's timing and the
workers' own histograms (vLLM's names: kvgate's worker and vLLM both export them).

  client          the mean TTFT the client saw (its first chunk with content)
  to worker       the client's less the workers': the gateway's routing and proxying, HTTP
                  both ways, the client's own loop
  to engine       the workers' TTFT (from their HTTP servers' arrival to the first token out)
                  less the engine's intervals: rendering, tokenizing, the way to the engine
                  core and back, and the wait for the core to take the request in (it reads
                  new requests between its steps, so a long step in progress delays it)
  engine queue    the engine's arrival to the request's admission to the running batch
  engine prefill  admission to the first token: its prompt's steps, which it shares with the
                  batch's decodes (and, in the sim, the host cost the preset charges to the
                  step that starts a request)

Means, not medians, because the parts of a mean add up to it (a median's do not). The sim's
parts beside a GPU run's say which part of its first tokens the sim gets wrong
(`bench.sim_check`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.lib.report import col, columns
from bench.lib.runs import Measured
from harness import worker_metrics as wm


@dataclass(slots=True)
class Parts:
    """One run's mean TTFT in milliseconds and its parts; the worker's parts are None where the
    workers timed none (a worker without the histograms)."""

    policy: str = col("policy", 13, left=True)
    round: int = col("run", 4)
    client_ms: float = col("client", 9, ".0f", "ms")
    to_worker_ms: float | None = col("to worker", 11, ".0f", "ms")
    to_engine_ms: float | None = col("to engine", 11, ".0f", "ms")
    queue_ms: float | None = col("engine queue", 14, ".0f", "ms")
    prefill_ms: float | None = col("engine prefill", 16, ".0f", "ms")


PARTS_COLUMNS = columns(Parts)


def first_token_parts(policy: str, m: Measured, round_: int = 0) -> Parts:
    """Run `m`'s mean TTFT (its answered, streamed requests) and the workers' parts of it."""
    ttfts = [r.ttft_s for r in m.results if r.ok and r.ttft_s is not None]
    client = statistics.fmean(ttfts) * 1e3 if ttfts else 0.0
    at = wm.first_token_parts(m.per_worker)
    if at is None:
        return Parts(policy, round_, round(client, 1), None, None, None, None)
    return Parts(
        policy,
        round_,
        round(client, 1),
        round(client - at.worker * 1e3, 1),
        round(at.to_engine * 1e3, 1),
        round(at.queue * 1e3, 1),
        round(at.prefill * 1e3, 1),
    )
