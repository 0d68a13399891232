"""What one worker sustains within the SLOs: prompt tokens and output tokens per second.

Two sources, both expressed as ``WorkerCapacity`` (prefill tokens/s at the TTFT target,
decode tokens/s at the ITL target), from which a pool's requests per second per worker follow
at the load's prompt and output lengths (``requests_per_s``):

* a **profile file** (``--profile``): measured once, offline, per pool, as Dynamo's planner
  profiles its engines;
* the **step-time fits** the KV router keeps (``router.kv.step_time``), fed here from the
  workers' own load reports, with the worker's limits from its model card (most running
  requests, KV cache size). ``from_step_model`` turns them into a steady-state estimate:

  with ``B`` requests decoding, ``u`` the KV share they hold, a prefill step ``p`` (prompt
  ``I`` beside ``B`` decodes) and a decode step ``d``, a worker finishing ``λ`` requests per
  second spends ``λ·p`` of each second in prefill, so ``λ = B / (d·O + B·p)`` for output
  length ``O``, its inter-token time is ``d / (1 - λ·p)`` and a new request waits about a
  prefill and a step, stretched the same way. The best ``λ`` over ``B`` up to a margin under
  the worker's batch limit (queueing past it is what breaks TTFT) that keeps both within the
  targets is the worker's capacity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from turnout.errors import ConfigError
from turnout.planner.connectors.base import POOLS
from turnout.router.kv.step_time import WorkerStepModel

#: Share of a worker's batch limit (``max_num_seqs``) planned for: the rest absorbs bursts
#: within an interval, before requests queue for a slot.
BATCH_MARGIN = 0.85
#: Batch limit assumed for a worker whose card names none (vLLM's default).
DEFAULT_MAX_SEQS = 256


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    """One worker's throughput within the SLOs, and where the figure comes from."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    #: ``profile``, ``step-model`` (fitted from reports) or ``step-prior`` (no report yet).
    source: str

    def requests_per_s(self, pool: str, prompt_tokens: float, output_tokens: float) -> float:
        """Requests per second one worker of ``pool`` sustains at these mean lengths: an
        aggregated worker does both phases, a prefill worker the prompt, a decode worker the
        output."""
        prompt = max(prompt_tokens, 1.0)
        output = max(output_tokens, 1.0)
        if pool == "prefill":
            return self.prefill_tokens_per_s / prompt
        if pool == "decode":
            return self.decode_tokens_per_s / output
        return 1.0 / (prompt / self.prefill_tokens_per_s + output / self.decode_tokens_per_s)

    def as_dict(self) -> dict[str, float | str]:
        return {
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "source": self.source,
        }


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """What a worker's card says bounds it: most running requests, KV cache in tokens."""

    max_num_seqs: int = DEFAULT_MAX_SEQS
    kv_tokens: int = 0  # 0: unknown (KV pressure is then left out)


def load_profile(path: str) -> dict[str, WorkerCapacity]:
    """A profile file: ``{"prefill_tokens_per_s": P, "decode_tokens_per_s": D}`` for every
    pool, or ``{"pools": {"decode": {...}, ...}}`` per pool. Bad files are a ``ConfigError``
    naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--profile {path}: cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--profile {path}: expected a JSON object")
    pools = data.get("pools")
    entries = pools if isinstance(pools, dict) else {pool: data for pool in POOLS}
    out: dict[str, WorkerCapacity] = {}
    for pool, entry in entries.items():
        if pool not in POOLS:
            raise ConfigError(f"--profile {path}: unknown pool {pool!r} (pools: {POOLS})")
        if not isinstance(entry, dict):
            raise ConfigError(f"--profile {path}: pool {pool!r} is not an object")
        values = []
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = entry.get(key)
            if (
                isinstance(value, bool)  # JSON true is no number, though Python's bool is
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"--profile {path}: {pool}.{key} must be a number above 0")
            values.append(float(value))
        out[pool] = WorkerCapacity(values[0], values[1], "profile")
    return out


def from_step_model(
    model: WorkerStepModel,
    limits: WorkerLimits,
    *,
    pool: str,
    prompt_tokens: float,
    output_tokens: float,
    ttft_slo: float,
    itl_slo: float,
    source: str,
) -> WorkerCapacity:
    """The steady-state capacity of one worker from its fitted step times (module docstring)."""
    prompt = max(int(prompt_tokens), 1)
    output = max(output_tokens, 1.0)
    per_request_kv = prompt + output / 2  # a running request holds its prompt and half its output
    most = max(1, round(limits.max_num_seqs * BATCH_MARGIN))

    def usage(batch: int) -> float:
        return min(batch * per_request_kv / limits.kv_tokens, 1.0) if limits.kv_tokens else 0.0

    if pool == "prefill":
        # Prompts alone, one after another: a queue with deterministic service ``p``; the mean
        # wait ``rho·p / 2(1 - rho)`` may take what the target leaves after the prefill itself.
        p = model.prefill_step_s(prompt, 0, 0.0)
        slack = max(ttft_slo - p, 0.0) / p if p > 0 else 0.0
        rho = 2 * slack / (1 + 2 * slack) if slack > 0 else 0.05
        rho = min(max(rho, 0.05), 0.9)
        return WorkerCapacity(rho * prompt / p, _decode_rate(model, most, usage, itl_slo), source)
    best_requests = 0.0
    best_batch = 1
    for batch in range(1, most + 1):
        u = usage(batch)
        d = model.decode_step_s(batch, u)
        p = model.prefill_step_s(prompt, batch, u) if pool == "aggregated" else 0.0
        rate = batch / (d * output + batch * p)
        busy = rate * p
        if busy >= 1.0:
            break
        itl = d / (1 - busy)
        ttft = (p + d) / (1 - busy)
        if itl > itl_slo or ttft > ttft_slo:
            break  # both grow with the batch: no larger one fits
        if rate > best_requests:
            best_requests, best_batch = rate, batch
    if best_requests == 0.0:
        # Not even one request at a time meets the targets: plan for one at a time (the SLO
        # rule then adds workers on what is observed).
        d = model.decode_step_s(1, usage(1))
        p = model.prefill_step_s(prompt, 1, usage(1)) if pool == "aggregated" else 0.0
        best_requests = 1.0 / (d * output + p)
    decode_tps = best_requests * output
    if pool == "decode":
        return WorkerCapacity(float("inf"), decode_tps, source)
    # Split the aggregated rate into the two phases' token rates, by the time each takes.
    u = usage(best_batch)
    p = model.prefill_step_s(prompt, best_batch, u)
    prefill_share = min(max(best_requests * p, 1e-6), 1 - 1e-6)
    return WorkerCapacity(
        prompt * best_requests / prefill_share,
        decode_tps / (1 - prefill_share),
        source,
    )


def _decode_rate(
    model: WorkerStepModel, most: int, usage: Callable[[int], float], itl_slo: float
) -> float:
    """Output tokens per second of a worker that only decodes, at the largest batch whose step
    meets ``itl_slo`` (unused by a prefill pool's decisions; kept for the record)."""
    best = 0.0
    for batch in range(1, most + 1):
        d = model.decode_step_s(batch, usage(batch))
        if d > itl_slo:
            break
        best = max(best, batch / d)
    return best or 1.0 / model.decode_step_s(1, 0.0)
