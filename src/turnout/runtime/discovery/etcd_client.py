"""The etcd v3 gRPC calls of the etcd store, on gRPC's public API only.

The messages come from ``etcd_v3.proto`` (generated into ``etcd_v3_pb2``); the calls are
named here by their method paths, which is all a gRPC stub is. Unary calls run on an asyncio
channel. Streaming calls (a watch, a lease keep-alive) run on a blocking channel, each read
by a thread of its own that hands the responses to the event loop: cancelling such a call
ends its thread at once, and the thread ending is something the store can await. An asyncio
streaming call instead leaves gRPC's internal task for its status running for a while after
a local cancellation, with no public way to await it, which would outlive a closed store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from turnout.runtime.discovery import etcd_v3_pb2 as pb

logger = logging.getLogger("turnout.runtime.discovery.etcd")

_Resp = TypeVar("_Resp", bound=Message)

Metadata = tuple[tuple[str, str], ...] | None

#: Longest wait for a cancelled stream's reader thread to end (it ends as soon as gRPC
#: fails the blocked read, normally within milliseconds).
STREAM_CLOSE_SECONDS = 5.0


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's ``range_end`` for every key starting with ``prefix``: the prefix with its last
    byte below 0xff incremented (and the 0xff bytes after it dropped); ``b"\\0"`` (to the end
    of the key space) when there is no such byte."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _unary(
    channel: grpc.aio.Channel, path: str, request: type[Message], response: type[_Resp]
) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        path,
        request_serializer=request.SerializeToString,
        response_deserializer=response.FromString,
    )


class EtcdCalls:
    """The unary etcd calls, bound to one endpoint's asyncio channel. Each takes the request
    message and gRPC's ``timeout`` and ``metadata`` keywords."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.range = _unary(channel, "/etcdserverpb.KV/Range", pb.RangeRequest, pb.RangeResponse)
        self.put = _unary(channel, "/etcdserverpb.KV/Put", pb.PutRequest, pb.PutResponse)
        self.delete_range = _unary(
            channel, "/etcdserverpb.KV/DeleteRange", pb.DeleteRangeRequest, pb.DeleteRangeResponse
        )
        self.compact = _unary(
            channel, "/etcdserverpb.KV/Compact", pb.CompactionRequest, pb.CompactionResponse
        )
        self.lease_grant = _unary(
            channel, "/etcdserverpb.Lease/LeaseGrant", pb.LeaseGrantRequest, pb.LeaseGrantResponse
        )
        self.lease_revoke = _unary(
            channel,
            "/etcdserverpb.Lease/LeaseRevoke",
            pb.LeaseRevokeRequest,
            pb.LeaseRevokeResponse,
        )
        self.lease_time_to_live = _unary(
            channel,
            "/etcdserverpb.Lease/LeaseTimeToLive",
            pb.LeaseTimeToLiveRequest,
            pb.LeaseTimeToLiveResponse,
        )
        self.lease_leases = _unary(
            channel,
            "/etcdserverpb.Lease/LeaseLeases",
            pb.LeaseLeasesRequest,
            pb.LeaseLeasesResponse,
        )
        self.authenticate = _unary(
            channel,
            "/etcdserverpb.Auth/Authenticate",
            pb.AuthenticateRequest,
            pb.AuthenticateResponse,
        )
        self.auth_enable = _unary(
            channel, "/etcdserverpb.Auth/AuthEnable", pb.AuthEnableRequest, pb.AuthEnableResponse
        )
        self.user_add = _unary(
            channel, "/etcdserverpb.Auth/UserAdd", pb.AuthUserAddRequest, pb.AuthUserAddResponse
        )
        self.user_grant_role = _unary(
            channel,
            "/etcdserverpb.Auth/UserGrantRole",
            pb.AuthUserGrantRoleRequest,
            pb.AuthUserGrantRoleResponse,
        )
        self.role_add = _unary(
            channel, "/etcdserverpb.Auth/RoleAdd", pb.AuthRoleAddRequest, pb.AuthRoleAddResponse
        )


class _End:
    """The marker a stream's thread posts last: how the call ended (``error`` None: etcd
    closed it normally)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class ThreadStream(Generic[_Resp]):
    """One bidirectional-streaming etcd call on a blocking channel, read by its own thread.

    It sends ``requests``, then half-closes the stream (``keep_open`` False: etcd answers and
    ends the call, as a lease keep-alive does) or keeps it open until ``close`` (a watch,
    which etcd never ends by itself). ``read`` returns the next response, or None once the
    call ended normally, and raises the call's ``grpc.RpcError`` when it failed. ``close``
    cancels the call and returns once its thread has ended; call it in a ``finally``.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        path: str,
        response: type[_Resp],
        requests: Sequence[Message],
        *,
        keep_open: bool,
        metadata: Metadata,
        timeout: float | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._responses: asyncio.Queue[_Resp | _End] = asyncio.Queue()
        self._ended: asyncio.Future[None] = self._loop.create_future()
        self._stop = threading.Event()
        self._done = False
        method = channel.stream_stream(
            path,
            request_serializer=type(requests[0]).SerializeToString,
            response_deserializer=response.FromString,
        )
        self._call: Any = method(
            self._requests(list(requests), keep_open), metadata=metadata, timeout=timeout
        )
        self._thread = threading.Thread(
            target=self._pump, name=f"turnout-etcd-stream {path}", daemon=True
        )
        self._thread.start()

    def _requests(self, requests: list[Message], keep_open: bool) -> Iterator[Message]:
        """The request side, consumed by gRPC's own thread: the requests, then either the
        half-close or a wait for the stream's end."""
        yield from requests
        if keep_open:
            self._stop.wait()

    def _post(self, item: _Resp | _End) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads any more
            self._loop.call_soon_threadsafe(self._responses.put_nowait, item)

    def _pump(self) -> None:
        """The reader thread: every response to the loop, then how the call ended."""
        error: BaseException | None = None
        try:
            for message in self._call:
                self._post(message)
        except BaseException as exc:  # grpc.RpcError; anything else is handed on too
            error = exc
        finally:
            self._stop.set()
            self._post(_End(error))
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._set_ended)

    def _set_ended(self) -> None:
        if not self._ended.done():
            self._ended.set_result(None)

    async def read(self) -> _Resp | None:
        """The next response; None once the call ended normally (then again on each read)."""
        if self._done:
            return None
        item = await self._responses.get()
        if isinstance(item, _End):
            self._done = True
            if item.error is not None:
                raise item.error
            return None
        return item

    async def close(self) -> None:
        """Cancel the call (when still running) and wait for its thread to end."""
        self._call.cancel()
        self._stop.set()
        try:
            await asyncio.wait([self._ended], timeout=STREAM_CLOSE_SECONDS)
        except asyncio.CancelledError:
            # Our caller is being cancelled: still let the thread go, then go on.
            await asyncio.wait([self._ended], timeout=STREAM_CLOSE_SECONDS)
            raise
        if not self._ended.done():
            logger.warning("etcd stream thread did not end within %gs", STREAM_CLOSE_SECONDS)
        # Drop what was not read: a failed call's exception holds its traceback's frames.
        while not self._responses.empty():
            self._responses.get_nowait()


WATCH = "/etcdserverpb.Watch/Watch"
LEASE_KEEP_ALIVE = "/etcdserverpb.Lease/LeaseKeepAlive"
