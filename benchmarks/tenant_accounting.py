"""CPU per request of the tenants' bookkeeping at the frontend, apart from HTTP.

Per request, what the frontend does for a tenant: admission (``TenantLimits.admit``: the
concurrency check, the token debt, the rps bucket), the prompt's charge, one output charge per
streamed token, the release, and the usage tallies (``TenantUsage``: in flight, tokens, the
request's outcome). Measured for a tenant without limits (no state kept) and one with all
three limits, over a pool of tenants so the dictionaries are not one entry; and the text
pipeline's body rewrite (a tenanted ``cache_salt``) for a short chat body.

Writes ``benchmarks/results/tenant_accounting.json``. Figures are CPU per request (process
time, so other processes on the machine count less), the best of ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec

from turnout.frontend.access.accounting import TenantAccount
from turnout.frontend.access.cache_space import CacheSpaces
from turnout.frontend.access.limits import PRINCIPAL_METADATA, TenantLimits
from turnout.frontend.access.principal import Principal, TenantPolicy
from turnout.frontend.access.usage import TenantUsage
from turnout.frontend.models.pipeline import TextPipeline
from turnout.protocols.model import ModelCapabilities
from turnout.runtime.context import RequestContext

RESULTS = Path(__file__).parent / "results" / "tenant_accounting.json"
#: Large enough that no bucket ever refuses during the run.
GENEROUS = TenantPolicy(rps=1e9, tokens_per_minute=1e15, max_concurrent=1_000_000)


def per_request(fn: Callable[[int], None], requests: int, repeat: int) -> float:
    """Best CPU microseconds per request over ``repeat`` rounds of ``requests`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for i in range(requests):
            fn(i)
        best = min(best, (time.process_time() - t0) / requests)
    return best * 1e6


def accounting(
    tenants: int, tokens: int, *, limited: bool, with_spaces: bool
) -> Callable[[int], None]:
    limits = TenantLimits()
    usage = TenantUsage(None)
    spaces = CacheSpaces()
    policy = GENEROUS if limited else TenantPolicy()
    principals = [Principal(f"t{i}", f"k{i}", policy=policy) for i in range(tenants)]

    def one(i: int) -> None:
        principal = principals[i % tenants]
        ctx = RequestContext("r")
        ctx.metadata[PRINCIPAL_METADATA] = principal
        account = TenantAccount(
            principal.tenant, limits.admit(principal), usage.tally(principal.tenant)
        )
        if with_spaces:
            spaces.tenant_of(ctx)
        account.charge_prompt(100)
        for _ in range(tokens):
            account.charge_output(1)
        account.settle(prompt=100, cached=0, output=tokens)
        account.close(200)

    return one


class _Relay:
    """A text pipeline's router that takes the body and streams nothing."""

    def generate(self, body: bytes, ctx: RequestContext) -> Any:
        return body


def text_relay(body: bytes) -> Callable[[int], None]:
    """A tenant's request through a text pipeline: its body gets the tenant's cache salt."""
    # generate reads the card's capabilities and name only, and not the instances
    card = cast(Any, SimpleNamespace(capabilities=ModelCapabilities(), display_name="m"))
    pipeline = TextPipeline("m", card, cast(Any, _Relay()), cast(Any, None), is_chat=True)
    ctx = RequestContext("r")
    ctx.metadata[PRINCIPAL_METADATA] = Principal("alice", "k")

    def one(i: int) -> None:
        pipeline.generate(body, ctx)

    return one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tenants", type=int, default=50)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for tokens in (1, 200):
        for limited in (False, True):
            fn = accounting(args.tenants, tokens, limited=limited, with_spaces=True)
            us = per_request(fn, args.requests, args.repeat)
            rows.append({"case": "accounting", "limited": limited, "output_tokens": tokens,
                         "cpu_us_per_request": round(us, 3)})  # fmt: skip
    body = msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "Hello " * 50}], "stream": True}
    )
    us = per_request(text_relay(body), args.requests, args.repeat)
    rows.append({"case": "text_body_salt", "body_bytes": len(body),
                 "cpu_us_per_request": round(us, 3)})  # fmt: skip
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
