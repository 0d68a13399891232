"""``redis://...`` (or ``rediss://``): the response store in Redis, shared by several frontends,
through redis-py's asyncio client.

Keys (``{t}``: the tenant, its ``%`` and ``:`` escaped as ``%25`` and ``%3A``; ``{id}``:
an id)::

    turnout:r:{t}:{id}    a response's record
    turnout:c:{t}:{id}    a conversation's record
    turnout:ci:{t}:{id}   its items: a hash, item id -> record
    turnout:co:{t}:{id}   their order: a list of item ids

The escaped tenant holds no colon, so the first colon after the kind ends it: no tenant and id
(a client names ids, colons included) spell another tenant's key.

Every key carries its expiry (``PXAT``): Redis drops what has expired by itself, so
``sweep`` has nothing to do. Writes that touch several keys of one conversation run as Lua
scripts or ``MULTI`` transactions, atomic against other frontends. Every call has a deadline
(``SOCKET_TIMEOUT_S``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from turnout.frontend.responses.store.base import ResponseStoreError
from turnout.runtime.redact import redact_url

#: Seconds to connect, and for any one reply.
SOCKET_TIMEOUT_S = 10.0

_T = TypeVar("_T")

#: KEYS: conversation, items, order; ARGV: expiry (ms), then item id, record pairs.
_ADD_ITEMS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('RPUSH', KEYS[3], ARGV[i])
end
for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], ARGV[1]) end
return 1
"""
#: KEYS: conversation, items, order; ARGV: item id.
_DELETE_ITEM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = redis.call('HDEL', KEYS[2], ARGV[1])
if n > 0 then redis.call('LREM', KEYS[3], 0, ARGV[1]) end
return n
"""


class RedisResponseStore:
    """The store in a Redis database (``url``: ``redis://host:port/db``)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.time) -> None:
        """``clock``: unused by Redis, which expires keys by its own clock; taken for the
        same constructor as the other backends."""
        self.url = url
        self.description = redact_url(url)
        self._redis: Any = None
        self._add_items: Any = None
        self._delete_item: Any = None

    async def open(self) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError as exc:
            raise ResponseStoreError(
                "--response-store redis:// needs redis-py (pip install 'turnout[stores]')"
            ) from exc
        self._redis = aioredis.from_url(
            self.url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
        )
        self._add_items = self._redis.register_script(_ADD_ITEMS)
        self._delete_item = self._redis.register_script(_DELETE_ITEM)
        from redis.exceptions import RedisError

        try:
            await self._redis.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            await self.close()
            raise ResponseStoreError(
                f"--response-store: cannot open {self.description}: {exc}"
            ) from exc

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()

    async def _call(self, fn: Callable[[Any], Awaitable[_T]]) -> _T:
        from redis.exceptions import RedisError

        if self._redis is None:
            raise ResponseStoreError("the response store is not open")
        try:
            return await fn(self._redis)
        except (RedisError, OSError, TimeoutError) as exc:
            raise ResponseStoreError(f"{self.description}: {exc}") from exc

    # -------------------------------------------------------------- responses

    async def put_response(
        self,
        tenant: str,
        response_id: str,
        data: bytes,
        expires_at: float,
        touch: Sequence[str] = (),
    ) -> None:
        at = _ms(expires_at)

        async def put(r: Any) -> None:
            async with r.pipeline(transaction=True) as pipe:
                pipe.set(_key("r", tenant, response_id), data, pxat=at)
                for other in touch:
                    pipe.pexpireat(_key("r", tenant, other), at)
                await pipe.execute()

        await self._call(put)

    async def get_responses(self, tenant: str, response_ids: Sequence[str]) -> dict[str, bytes]:
        if not response_ids:
            return {}

        async def get(r: Any) -> dict[str, bytes]:
            values = await r.mget([_key("r", tenant, i) for i in response_ids])
            return {i: bytes(v) for i, v in zip(response_ids, values, strict=True) if v}

        return await self._call(get)

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        async def delete(r: Any) -> bool:
            return bool(await r.delete(_key("r", tenant, response_id)))

        return await self._call(delete)

    # -------------------------------------------------------------- conversations

    async def put_conversation(
        self, tenant: str, conversation_id: str, data: bytes, expires_at: float
    ) -> None:
        at = _ms(expires_at)
        conv, items, order = _conversation_keys(tenant, conversation_id)

        async def put(r: Any) -> None:
            async with r.pipeline(transaction=True) as pipe:
                pipe.set(conv, data, pxat=at)
                pipe.pexpireat(items, at)
                pipe.pexpireat(order, at)
                await pipe.execute()

        await self._call(put)

    async def get_conversation(self, tenant: str, conversation_id: str) -> bytes | None:
        async def get(r: Any) -> bytes | None:
            value = await r.get(_key("c", tenant, conversation_id))
            return None if value is None else bytes(value)

        return await self._call(get)

    async def delete_conversation(self, tenant: str, conversation_id: str) -> bool:
        conv, items, order = _conversation_keys(tenant, conversation_id)

        async def delete(r: Any) -> bool:
            async with r.pipeline(transaction=True) as pipe:
                pipe.delete(conv)
                pipe.delete(items, order)
                deleted, _ = await pipe.execute()
            return bool(deleted)

        return await self._call(delete)

    async def add_items(
        self,
        tenant: str,
        conversation_id: str,
        items: Sequence[tuple[str, bytes]],
        expires_at: float,
    ) -> bool:
        keys = list(_conversation_keys(tenant, conversation_id))
        args: list[Any] = [_ms(expires_at)]
        for item_id, data in items:
            args += [item_id, data]
        return bool(await self._call(lambda r: self._add_items(keys=keys, args=args)))

    async def list_items(self, tenant: str, conversation_id: str) -> list[tuple[str, bytes]]:
        conv, items, order = _conversation_keys(tenant, conversation_id)

        async def read(r: Any) -> list[tuple[str, bytes]]:
            async with r.pipeline(transaction=True) as pipe:
                pipe.exists(conv)
                pipe.lrange(order, 0, -1)
                pipe.hgetall(items)
                live, ids, records = await pipe.execute()
            if not live:
                return []
            out = []
            for raw in ids:
                data = records.get(raw)
                if data is not None:
                    out.append((raw.decode(), bytes(data)))
            return out

        return await self._call(read)

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool:
        keys = list(_conversation_keys(tenant, conversation_id))
        return bool(await self._call(lambda r: self._delete_item(keys=keys, args=[item_id])))

    async def sweep(self) -> int:
        return 0


def _key(kind: str, tenant: str, ident: str) -> str:
    escaped = tenant.replace("%", "%25").replace(":", "%3A")
    return f"turnout:{kind}:{escaped}:{ident}"


def _conversation_keys(tenant: str, conversation_id: str) -> tuple[str, str, str]:
    return (
        _key("c", tenant, conversation_id),
        _key("ci", tenant, conversation_id),
        _key("co", tenant, conversation_id),
    )


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
