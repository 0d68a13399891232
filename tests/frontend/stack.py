"""An in-process turnout stack for tests: runtime, frontend on a real port, echo workers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tests.polling import eventually

from turnout.engines.base import Engine
from turnout.engines.echo import EchoEngine
from turnout.engines.worker import Worker
from turnout.frontend.service import Frontend, FrontendConfig, free_port
from turnout.protocols.block_hashing import compute_seq_hashes
from turnout.protocols.model import EndpointId, ModelDeploymentCard
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.discovery.memory import MemoryStore

ENDPOINT = EndpointId(namespace="test", component="backend", name="generate")


@dataclass
class Stack:
    runtime: DistributedRuntime
    frontend: Frontend
    workers: list[Worker] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.frontend.url

    async def add_worker(
        self,
        engine: Engine,
        *,
        model_name: str = "echo",
        endpoint: EndpointId = ENDPOINT,
        **options: Any,
    ) -> Worker:
        """Start a worker of ``engine``; ``options``: more of ``Worker``'s keywords."""
        worker = Worker(self.runtime, engine, endpoint, model_name=model_name, **options)
        await worker.start()
        self.workers.append(worker)
        return worker

    async def wait_for_model(self, name: str, instances: int = 1, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            manager = self.frontend.manager
            if name in manager.list_models() and len(manager.model_instances(name)) >= instances:
                return
            await asyncio.sleep(0.02)
        raise TimeoutError(f"model {name!r} with {instances} instance(s) did not appear")

    async def wait_for_cached_blocks(
        self,
        model: str,
        tokens: list[int],
        blocks: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        """Wait until ``model``'s KV router has applied the KV events that put ``blocks`` of
        ``tokens``' blocks on one worker (what the next request's routing will see)."""
        router = self.frontend.factory.kv_routers[model]
        seq = compute_seq_hashes(
            tokens, router.config.block_size, lora_name=lora_name, cache_salt=cache_salt
        )
        await eventually(
            lambda: max(router.core.index.find_matches(seq).scores.values(), default=0) >= blocks,
            timeout=timeout,
            what=f"{blocks} blocks of the prompt indexed by {model!r}'s KV router",
        )

    async def close(self) -> None:
        for worker in self.workers:
            await worker.stop(drain_timeout=1.0)
        await self.frontend.stop()
        await self.runtime.shutdown()


async def make_stack(**config: object) -> Stack:
    runtime = await DistributedRuntime.create(
        store=MemoryStore(), request_plane=str(config.pop("request_plane", "tcp")), lease_ttl=5.0
    )
    # The Responses API's store in memory unless a test names one: stacks are many and short.
    config.setdefault("response_store", "memory:")
    cfg = FrontendConfig(port=free_port(), **config)  # type: ignore[arg-type]
    frontend = Frontend(cfg, runtime=runtime)
    await frontend.start()
    return Stack(runtime=runtime, frontend=frontend)


def echo_engine(gguf_path: str, **kwargs: object) -> EchoEngine:
    return EchoEngine(gguf_path, **kwargs)  # type: ignore[arg-type]


#: Every message as "role: content", then the end-of-sequence token: the echo answers with
#: the whole conversation and stops (SmolLM2's own template ends its system turn with that
#: token first, and the Responses API has no ``ignore_eos`` to go past it).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}{{ eos_token }}"
)


class WholePromptEcho(EchoEngine):
    """An echo whose chat template writes the whole conversation, then the end token."""

    def model_card_template(self) -> ModelDeploymentCard:
        return msgspec.structs.replace(super().model_card_template(), chat_template=TEMPLATE)
