"""Mutual TLS on the tcp request plane: a worker serves nothing, its artifacts included, to a
peer that cannot show a certificate the deployment CA signed, logs the refusal (rate-limited),
and serves the frontend's runtime; the client refuses a server it cannot authenticate."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.certs import Leaf, TestCa
from tests.polling import eventually

from turnout.cli.flags import planes_config
from turnout.cli.main import build_parser
from turnout.cli.serve import worker_argv
from turnout.errors import ConfigError, PeerUnavailable
from turnout.protocols.model import ARTIFACT_HANDLER, EndpointId, TransportAddress
from turnout.runtime.component import DistributedRuntime
from turnout.runtime.context import RequestContext
from turnout.runtime.discovery import MemoryStore
from turnout.runtime.plane_tls import PlaneTls
from turnout.runtime.planes import PlanesConfig, open_runtime
from turnout.runtime.request_plane import TcpClient, TcpServer, make_client, make_server
from turnout.runtime.request_plane.framing import Frame, FrameReader, FrameWriter, Kind
from turnout.runtime.request_plane.tcp import split_address
from turnout.runtime.request_plane.tcp.tls import TlsAcceptor, tls_refusal_log

EID = EndpointId(namespace="ns", component="backend", name="generate")
TOKENIZER = b'{"model": "the tokenizer a worker must not hand out"}'


def tls(leaf: Leaf) -> PlaneTls:
    return PlaneTls(leaf.ca, leaf.cert, leaf.key)


@pytest.fixture
def ca(tmp_path: Path) -> TestCa:
    return TestCa(tmp_path)


@pytest.fixture
def other_ca(tmp_path: Path) -> TestCa:
    return TestCa(tmp_path, name="other")


class Worker:
    """A TLS request-plane server with a generate and an artifact handler that record calls."""

    def __init__(self, plane_tls: PlaneTls, **options: float) -> None:
        self.server = TcpServer(plane_tls=plane_tls, **options)  # type: ignore[arg-type]
        self.calls: list[str] = []
        self.server.register("generate", self._generate)
        self.server.register(ARTIFACT_HANDLER, self._artifact)

    async def _generate(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        self.calls.append("generate")
        for token in payload.split():
            yield token

    async def _artifact(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        self.calls.append("artifact")
        yield TOKENIZER

    async def __aenter__(self) -> TransportAddress:
        return await self.server.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()


async def collect(
    client: TcpClient, address: TransportAddress, path: str, payload: bytes
) -> list[bytes]:
    stream = client.stream(address, path, payload, RequestContext("r"))
    try:
        return [item async for item in stream]
    finally:
        await stream.aclose()


def request_frames(*paths: str) -> bytes:
    writer = FrameWriter()
    for sid, path in enumerate(paths, 1):
        writer.append(Frame(Kind.REQUEST, sid, b"a b", path, 0, "r"))
    return bytes(writer.take())


async def read_all(reader: asyncio.StreamReader, limit: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (or resets it)."""
    data = b""
    try:
        async with asyncio.timeout(limit):
            while chunk := await reader.read(65536):
                data += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    return data


def no_frames(data: bytes) -> bool:
    """True when ``data`` holds no request-plane frame (a TLS alert record is not one)."""
    try:
        return not FrameReader(1 << 20).feed(data)
    except Exception:
        return True


async def test_the_right_client_is_served(ca: TestCa) -> None:
    worker = Worker(tls(ca.issue("worker")))
    client = TcpClient(plane_tls=tls(ca.issue("frontend")))
    try:
        async with worker as address:
            assert await collect(client, address, "generate", b"a b c") == [b"a", b"b", b"c"]
            assert await collect(client, address, ARTIFACT_HANDLER, b"") == [TOKENIZER]
            assert worker.server.refusals.num_refused == 0
    finally:
        await client.close()


@pytest.mark.parametrize("send", [True, False], ids=["frames", "silent"])
async def test_a_raw_tcp_client_gets_nothing_and_is_logged(
    ca: TestCa, caplog: pytest.LogCaptureFixture, send: bool
) -> None:
    worker = Worker(tls(ca.issue("worker")), tls_handshake_timeout=0.3)
    caplog.set_level(logging.WARNING, "turnout.runtime")
    async with worker as address:
        host, port = split_address(address.address)
        reader, writer = await asyncio.open_connection(host, port)
        if send:
            writer.write(request_frames(ARTIFACT_HANDLER, "generate"))
        local = "{}:{}".format(*writer.get_extra_info("sockname")[:2])
        try:
            data = await read_all(reader)
        finally:
            writer.close()
        assert no_frames(data) and TOKENIZER not in data
        await eventually(lambda: worker.server.refusals.num_refused == 1)
        assert worker.calls == []
    lines = [r.getMessage() for r in caplog.records if "refused TLS handshake" in r.getMessage()]
    assert len(lines) == 1 and local in lines[0], lines
    reason = "WRONG_VERSION_NUMBER" if send else "handshake"
    assert reason in lines[0] or (send and "record" in lines[0].lower()), lines[0]


async def test_a_client_certificate_from_another_ca_is_refused(
    ca: TestCa, other_ca: TestCa, caplog: pytest.LogCaptureFixture
) -> None:
    worker = Worker(tls(ca.issue("worker")))
    # It trusts the deployment's CA (so it would accept the worker) but shows another's cert.
    stranger = other_ca.issue("stranger")
    client = TcpClient(plane_tls=PlaneTls(ca.ca_path.as_posix(), stranger.cert, stranger.key))
    caplog.set_level(logging.WARNING, "turnout.runtime")
    try:
        async with worker as address:
            for path in ("generate", ARTIFACT_HANDLER):
                with pytest.raises(PeerUnavailable, match="refuse this process's --plane-cert"):
                    await collect(client, address, path, b"a b")
            assert worker.calls == []
            await eventually(lambda: worker.server.refusals.num_refused == 2)
    finally:
        await client.close()
    lines = [
        r.getMessage() for r in caplog.records if "refused TLS handshake from" in r.getMessage()
    ]
    assert len(lines) == 1 and "certificate verify failed" in lines[0], lines


async def test_a_client_without_a_certificate_is_refused(ca: TestCa) -> None:
    worker = Worker(tls(ca.issue("worker")))
    context = ssl.create_default_context(cafile=str(ca.ca_path))  # verifies, shows nothing
    async with worker as address:
        host, port = split_address(address.address)
        reader, writer = await asyncio.open_connection(host, port, ssl=context)
        writer.write(request_frames(ARTIFACT_HANDLER, "generate"))
        try:
            data = await read_all(reader)
        finally:
            writer.close()
        assert data == b""
        await eventually(lambda: worker.server.refusals.num_refused == 1)
        assert worker.calls == []
        reasons = dict(worker.server.refusals.counts)
    assert reasons == {"PEER_DID_NOT_RETURN_A_CERTIFICATE": 1}, reasons


@pytest.mark.parametrize(
    "server_hosts, server_ca, reason",
    [
        (("127.0.0.1", "localhost"), "other", "unable to get local issuer certificate"),
        (("worker-7.example",), "deployment", "IP address mismatch"),
    ],
    ids=["another-ca", "wrong-host"],
)
async def test_the_client_refuses_a_server_it_cannot_authenticate(
    ca: TestCa, other_ca: TestCa, server_hosts: tuple[str, ...], server_ca: str, reason: str
) -> None:
    issuer = ca if server_ca == "deployment" else other_ca
    leaf = issuer.issue("worker", hosts=server_hosts)
    # The server itself trusts the deployment CA: only its own certificate is wrong.
    worker = Worker(PlaneTls(ca.ca_path.as_posix(), leaf.cert, leaf.key))
    client = TcpClient(plane_tls=tls(ca.issue("frontend")))
    try:
        async with worker as address:
            with pytest.raises(PeerUnavailable, match=reason):
                await collect(client, address, "generate", b"a b")
            assert worker.calls == []
            assert client.refusals.num_refused == 1
    finally:
        await client.close()


async def test_a_plain_client_cannot_reach_a_tls_server_or_the_reverse(ca: TestCa) -> None:
    worker = Worker(tls(ca.issue("worker")), tls_handshake_timeout=0.3)
    plain = TcpClient(handshake_timeout=0.5)
    try:
        async with worker as address:
            with pytest.raises(PeerUnavailable):
                await collect(plain, address, "generate", b"a")
        assert worker.calls == []
    finally:
        await plain.close()
    server = TcpServer()
    server.register("generate", worker._generate)
    client = TcpClient(plane_tls=tls(ca.issue("frontend")))
    try:
        address = await server.start()
        with pytest.raises(PeerUnavailable, match="TLS handshake"):
            await collect(client, address, "generate", b"a")
        assert worker.calls == []
    finally:
        await client.close()
        await server.stop()


class Greeter(asyncio.Protocol):
    """Says hello once its peer passed the TLS handshake."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"hello")  # type: ignore[attr-defined]


def ended(sock: socket.socket) -> bool:
    """True once the server ended ``sock`` (EOF or reset), without blocking."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


async def greeted(ca: TestCa, host: str, port: int) -> bytes:
    """What a proper client (a certificate the deployment CA signed) reads after its handshake."""
    context = tls(ca.issue("frontend")).client_context()
    reader, writer = await asyncio.open_connection(host, port, ssl=context)
    try:
        async with asyncio.timeout(5):
            return await reader.readexactly(5)
    finally:
        writer.close()


async def test_a_flood_fills_no_slot_a_proper_client_needs(ca: TestCa) -> None:
    """Silent connections past the cap of handshakes at once evict the oldest pending ones:
    the flood's own, and a proper client that connects after it completes its handshake."""
    refusals = tls_refusal_log()
    acceptor = TlsAcceptor(
        Greeter,
        tls(ca.issue("worker")).server_context(),
        refusals,
        max_pending=2,
        max_pending_per_host=1000,  # every test peer is 127.0.0.1
    )
    host, port = acceptor.listen("127.0.0.1", 0)
    flood = [socket.create_connection((host, port)) for _ in range(6)]
    try:
        assert await greeted(ca, host, port) == b"hello"
        evicted = "evicted: too many TLS handshakes at once"
        await eventually(lambda: refusals.counts == {evicted: 5})
        await eventually(lambda: all(ended(sock) for sock in flood[:5]))
        assert not ended(flood[5])  # the youngest still holds its slot
    finally:
        for sock in flood:
            sock.close()
        await acceptor.close()


async def test_handshakes_at_once_from_one_host_are_bounded(ca: TestCa) -> None:
    """A host past its cap of handshakes at once has its further connections aborted; the
    ones it holds are kept (it cannot evict them, nor anyone's, from one address)."""
    refusals = tls_refusal_log()
    acceptor = TlsAcceptor(
        Greeter, tls(ca.issue("worker")).server_context(), refusals, max_pending_per_host=2
    )
    host, port = acceptor.listen("127.0.0.1", 0)
    socks = [socket.create_connection((host, port)) for _ in range(3)]
    try:
        reason = "too many TLS handshakes from one host"
        await eventually(lambda: refusals.counts == {reason: 1})
        await eventually(lambda: ended(socks[2]))
        assert not ended(socks[0]) and not ended(socks[1])
        for sock in socks[:2]:  # the host's slots come back as its handshakes end
            sock.close()
        await eventually(lambda: not acceptor._per_host)
        assert await greeted(ca, host, port) == b"hello"
    finally:
        for sock in socks:
            sock.close()
        await acceptor.close()


async def test_the_frontend_runtime_is_served_through_the_component_layer(ca: TestCa) -> None:
    store = MemoryStore()
    worker = await DistributedRuntime.create(store=store, plane_tls=tls(ca.issue("worker")))
    frontend = await DistributedRuntime.create(store=store, plane_tls=tls(ca.issue("frontend")))
    try:

        async def generate(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
            yield payload

        served = await worker.endpoint(EID).serve(generate)
        client = await frontend.endpoint(EID).client()
        items = [x async for x in client.stream(served.instance_id, b"hello", RequestContext())]
        assert items == [b"hello"]
    finally:
        await frontend.shutdown()
        await worker.shutdown()
        await store.close()


def test_the_registry_passes_plane_tls_to_tcp_only(ca: TestCa) -> None:
    plane_tls = tls(ca.issue("worker"))
    server = make_server("tcp", plane_tls=plane_tls)
    client = make_client("tcp", plane_tls=plane_tls)
    assert isinstance(server, TcpServer) and server._tls is not None
    assert isinstance(client, TcpClient) and client._tls is not None
    assert make_server("local", plane_tls=plane_tls).kind == "local"


@pytest.mark.parametrize(
    "given",
    [("ca",), ("cert",), ("key",), ("ca", "cert"), ("cert", "key"), ("ca", "key")],
)
def test_partial_plane_flags_are_a_config_error(ca: TestCa, given: tuple[str, ...]) -> None:
    leaf = ca.issue("worker")
    values = {
        name: getattr(leaf, name) if name in given else None for name in ("ca", "cert", "key")
    }
    with pytest.raises(ConfigError, match="missing --plane-"):
        PlaneTls.from_flags(values["ca"], values["cert"], values["key"])


def test_plane_files_that_do_not_load_are_a_config_error(ca: TestCa, tmp_path: Path) -> None:
    leaf = ca.issue("worker")
    other_key = TestCa(tmp_path, name="x").issue("y").key
    with pytest.raises(ConfigError, match="cannot load the plane TLS files"):
        PlaneTls.from_flags(leaf.ca, leaf.cert, other_key)
    with pytest.raises(ConfigError, match="cannot load"):
        PlaneTls.from_flags(str(tmp_path / "absent.pem"), leaf.cert, leaf.key)


# --- which processes take the plane flags, and what they are refused or warned about ------------


def planes(**fields: Any) -> PlanesConfig:
    return PlanesConfig(**fields)


@pytest.mark.parametrize("bind_host", ["0.0.0.0", "::", "10.1.2.3", "worker-7.example"])
def test_binding_a_non_loopback_address_in_the_clear_warns_once(
    caplog: pytest.LogCaptureFixture, bind_host: str
) -> None:
    caplog.set_level(logging.WARNING, "turnout.runtime")
    assert planes(bind_host=bind_host).maybe_warn_plaintext()
    (line,) = [r.getMessage() for r in caplog.records]
    assert bind_host in line and "the tcp request plane and the zmq event plane" in line
    assert "--plane-ca/--plane-cert/--plane-key" in line


@pytest.mark.parametrize(
    "fields",
    [
        {"bind_host": "127.0.0.1"},
        {"bind_host": "127.0.0.2"},
        {"bind_host": "::1"},
        {"bind_host": "localhost"},
        {"bind_host": "0.0.0.0", "request_plane": "nats", "event_plane": "nats"},
    ],
    ids=["loopback", "loopback-8", "loopback-v6", "localhost", "nats-only"],
)
def test_no_warning_on_loopback_or_without_a_tcp_or_zmq_plane(
    caplog: pytest.LogCaptureFixture, fields: dict[str, str]
) -> None:
    caplog.set_level(logging.WARNING, "turnout.runtime")
    assert not planes(**fields).maybe_warn_plaintext()
    assert caplog.records == []


def test_no_warning_with_plane_tls(ca: TestCa, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "turnout.runtime")
    assert not planes(bind_host="0.0.0.0", plane_tls=tls(ca.issue("w"))).maybe_warn_plaintext()
    assert caplog.records == []


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"request_plane": "nats", "event_plane": "nats"}, "--nats-ca-cert, --nats-cert"),
        ({"store": "memory", "request_plane": "local"}, "the local event plane"),
    ],
    ids=["nats-only", "local-only"],
)
def test_plane_flags_where_no_plane_uses_them_are_a_config_error(
    ca: TestCa, fields: dict[str, str], message: str
) -> None:
    config = planes(plane_tls=tls(ca.issue("w")), **fields)
    with pytest.raises(ConfigError, match="would protect nothing") as err:
        config.check_plane_tls()
    assert message in str(err.value)


@pytest.mark.parametrize(
    "fields, protected",
    [
        ({}, ["the tcp request plane", "the zmq event plane"]),
        ({"request_plane": "nats"}, ["the zmq event plane"]),
        ({"event_plane": "nats"}, ["the tcp request plane"]),
        ({"store": "memory"}, ["the tcp request plane"]),  # its event plane is local
    ],
)
def test_plane_flags_protect_the_tcp_and_zmq_planes(
    ca: TestCa, fields: dict[str, str], protected: list[str]
) -> None:
    config = planes(plane_tls=tls(ca.issue("w")), **fields)
    config.check_plane_tls()
    assert config.tls_planes() == protected


async def test_opening_nats_only_planes_with_plane_flags_fails_before_connecting(
    ca: TestCa,
) -> None:
    config = planes(
        store="memory", request_plane="nats", event_plane="nats", plane_tls=tls(ca.issue("w"))
    )
    with pytest.raises(ConfigError, match="--nats-ca-cert"):
        await open_runtime(config)


def test_etcd_nats_and_plane_tls_flags_compose(ca: TestCa) -> None:
    """One process with every TLS at once: etcd's client TLS for the store, NATS's for the
    event plane, and plane TLS on the tcp request plane: each lands where its plane reads it."""
    store, nats, plane = ca.issue("etcd-client"), ca.issue("nats-client"), ca.issue("worker")
    args = build_parser().parse_args(
        ["worker",
         "--store", "etcd", "--store-endpoints", "https://127.0.0.1:2379",
         "--store-ca-cert", store.ca, "--store-cert", store.cert, "--store-key", store.key,
         "--event-plane", "nats", "--nats-url", "tls://127.0.0.1:4222",
         "--nats-ca-cert", nats.ca, "--nats-cert", nats.cert, "--nats-key", nats.key,
         "--plane-ca", plane.ca, "--plane-cert", plane.cert, "--plane-key", plane.key]
    )  # fmt: skip
    config = planes_config(args)
    config.check_plane_tls()
    assert config.store_options == {
        "endpoints": ["https://127.0.0.1:2379"],
        "ca_cert": store.ca,
        "cert": store.cert,
        "key": store.key,
    }
    assert config.nats is not None
    assert (config.nats.ca_cert, config.nats.cert, config.nats.key) == (
        nats.ca,
        nats.cert,
        nats.key,
    )
    assert config.plane_tls == PlaneTls(plane.ca, plane.cert, plane.key)
    assert config.tls_planes() == ["the tcp request plane"]


@pytest.mark.parametrize("command", ["worker", "frontend", "router", "attach", "status", "serve"])
def test_every_process_that_reaches_a_plane_takes_the_plane_flags(ca: TestCa, command: str) -> None:
    leaf = ca.issue("p")
    flags = ["--plane-ca", leaf.ca, "--plane-cert", leaf.cert, "--plane-key", leaf.key]
    extra = {"serve": ["--engine", "echo"], "attach": ["--url", "http://127.0.0.1:1"]}
    args = build_parser().parse_args([command, *extra.get(command, []), *flags])
    assert planes_config(args).plane_tls == PlaneTls(leaf.ca, leaf.cert, leaf.key)


def test_serve_hands_its_plane_flags_to_its_workers(ca: TestCa) -> None:
    leaf = ca.issue("p")
    flags = ["--plane-ca", leaf.ca, "--plane-cert", leaf.cert, "--plane-key", leaf.key]
    argv = worker_argv(build_parser().parse_args(["serve", "--engine", "echo", *flags]), "/s", 1)
    assert " ".join(flags) in " ".join(argv)
    plain = worker_argv(build_parser().parse_args(["serve", "--engine", "echo"]), "/s", 1)
    assert not any(arg.startswith("--plane-") for arg in plain)
