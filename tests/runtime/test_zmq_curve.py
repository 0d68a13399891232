"""CurveZMQ on the zmq event plane: only processes with a certificate from the deployment CA
publish to or receive from each other; anyone else who reaches a PUB socket gets nothing."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from tests.certs import Leaf, TestCa
from tests.polling import eventually
from zmq.utils.monitor import parse_monitor_message

from turnout.protocols.kv import KV_EVENTS_TOPIC
from turnout.runtime.discovery.memory import MemoryStore
from turnout.runtime.event_plane import EventPublisher, EventSubscription, zap
from turnout.runtime.event_plane import zmq as zmq_plane
from turnout.runtime.event_plane.curve import (
    Attestation,
    AttestationVerifier,
    CurveCredentials,
    CurveIdentity,
    check_publisher,
)
from turnout.runtime.event_plane.zap import PLANE_KEYS_ROOT
from turnout.runtime.event_plane.zmq import ZmqEventPlane, publishers_key
from turnout.runtime.plane_tls import PlaneTls

PROBE = b"\x00probe"
#: How long a test watches a socket that must stay silent while messages are published.
SILENCE_S = 0.5


def tls_of(leaf: Leaf) -> PlaneTls:
    return PlaneTls(leaf.ca, leaf.cert, leaf.key)


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    s = MemoryStore()
    yield s
    await s.close()


@pytest.fixture
def ca(tmp_path: Path) -> TestCa:
    return TestCa(tmp_path)


@pytest.fixture
def zmq_context() -> Iterator[zmq.asyncio.Context]:
    """A context for raw sockets (an outsider's); destroyed after the test."""
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def join(pub: EventPublisher, sub: EventSubscription) -> None:
    """Probe until ``sub`` receives one (the handshakes take a while), then drain the rest."""
    async with asyncio.timeout(10):
        while True:
            await pub.publish(KV_EVENTS_TOPIC, PROBE)
            try:
                async with asyncio.timeout(0.05):
                    await anext(sub)
                    break
            except TimeoutError:
                continue
    while sub.num_pending:
        await anext(sub)


async def publish_while_silent(
    pub: EventPublisher, sub: EventSubscription, sock: zmq.asyncio.Socket
) -> None:
    """Publish for ``SILENCE_S`` while ``sub`` (admitted) receives it all and ``sock`` nothing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SILENCE_S
    sent = 0
    while loop.time() < deadline:
        await pub.publish(KV_EVENTS_TOPIC, b"secret block hashes")
        sent += 1
        assert not await sock.poll(timeout=20), "an outsider received an event"
    async with asyncio.timeout(10):
        for _ in range(sent):
            assert (await anext(sub)).payload == b"secret block hashes"


async def test_events_flow_both_ways_between_planes_of_one_ca(
    store: MemoryStore, ca: TestCa
) -> None:
    a = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("worker")))
    b = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("router")))
    async with a, b:
        pub_a, pub_b = await a.publisher("dyn", "a"), await b.publisher("dyn", "b")
        sub_b, sub_a = await b.subscribe("dyn", "a", ""), await a.subscribe("dyn", "b", "")
        await join(pub_a, sub_b)
        await join(pub_b, sub_a)
        await pub_a.publish("load", b"from a")
        await pub_b.publish("load", b"from b")
        async with asyncio.timeout(10):
            assert await anext(sub_b) == ("load", b"from a")
            assert await anext(sub_a) == ("load", b"from b")
        # The publisher's record carries its attestation; each subscribing plane has a key record.
        kv = await store.get(publishers_key("dyn", "a", pub_a.publisher_id))
        assert kv is not None
        record = msgspec.json.decode(kv.value)
        assert b.curve is not None and a.curve is not None
        assert record["attestation"]["curve_key"] == a.curve.identity.public_key.decode()
        assert len(await store.get_prefix(PLANE_KEYS_ROOT)) == 2
    assert await store.get_prefix(PLANE_KEYS_ROOT) == []
    assert await store.get_prefix("v1/event_publishers/") == []


async def test_plain_planes_write_the_same_records(store: MemoryStore) -> None:
    async with ZmqEventPlane(store) as plane:
        pub = await plane.publisher("dyn", "a")
        await plane.subscribe("dyn", "a", "")
        kv = await store.get(publishers_key("dyn", "a", pub.publisher_id))
        assert kv is not None
        keys = list(msgspec.json.decode(kv.value))
        assert keys == ["address", "publisher_id", "namespace", "component", "hostname", "pid"]
        assert await store.get_prefix(PLANE_KEYS_ROOT) == []


async def test_raw_plain_subscriber_gets_nothing(
    store: MemoryStore, ca: TestCa, zmq_context: zmq.asyncio.Context
) -> None:
    pub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("worker")))
    sub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("router")))
    async with pub_plane, sub_plane:
        pub = await pub_plane.publisher("dyn", "backend")
        sub = await sub_plane.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
        await join(pub, sub)
        raw = zmq_context.socket(zmq.SUB)
        monitor = raw.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        try:
            raw.setsockopt(zmq.SUBSCRIBE, b"")
            raw.connect(pub.address)
            # The publisher refuses the plain (NULL) handshake: wait until the client says so.
            async with asyncio.timeout(10):
                event = parse_monitor_message(await monitor.recv_multipart())
            assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            await publish_while_silent(pub, sub, raw)
        finally:
            raw.disable_monitor()
            monitor.close(linger=0)
            raw.close(linger=0)


async def test_curve_client_with_an_unattested_key_gets_nothing(
    store: MemoryStore,
    ca: TestCa,
    zmq_context: zmq.asyncio.Context,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("worker")), auth_grace=0.05)
    sub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("router")))
    async with pub_plane, sub_plane:
        pub = await pub_plane.publisher("dyn", "backend")
        sub = await sub_plane.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
        await join(pub, sub)
        assert pub_plane.curve is not None and pub_plane._gate is not None
        public, secret = zmq.curve_keypair()
        raw = zmq_context.socket(zmq.SUB)
        try:
            raw.setsockopt(zmq.CURVE_PUBLICKEY, public)
            raw.setsockopt(zmq.CURVE_SECRETKEY, secret)
            raw.setsockopt(zmq.CURVE_SERVERKEY, pub_plane.curve.identity.public_key)
            raw.setsockopt(zmq.SUBSCRIBE, b"")
            with caplog.at_level(logging.WARNING, "turnout.runtime.event_plane.zap"):
                raw.connect(pub.address)
                gate = pub_plane._gate
                await eventually(lambda: gate.refusals.num_refused >= 1, what="a ZAP refusal")
                await publish_while_silent(pub, sub, raw)
        finally:
            raw.close(linger=0)
    refusals = [r.getMessage() for r in caplog.records if "refused subscriber" in r.message]
    assert refusals and public.decode() in refusals[0], caplog.text


async def test_plane_of_another_ca_gets_nothing_and_is_logged(
    store: MemoryStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours, theirs = TestCa(tmp_path, "ours"), TestCa(tmp_path, "theirs")
    pub_plane = ZmqEventPlane(store, plane_tls=tls_of(ours.issue("worker")), auth_grace=0.05)
    friend = ZmqEventPlane(store, plane_tls=tls_of(ours.issue("router")))
    stranger = ZmqEventPlane(store, plane_tls=tls_of(theirs.issue("router")))
    with caplog.at_level(logging.WARNING, "turnout.runtime.event_plane"):
        async with pub_plane, friend, stranger:
            pub = await pub_plane.publisher("dyn", "backend")
            assert pub_plane._gate is not None
            sub = await friend.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
            outsider = await stranger.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
            await join(pub, sub)
            gate = pub_plane._gate
            # The publisher does not admit the stranger's key (its attestation is not from our
            # CA) and the stranger does not connect to a publisher our CA vouches for.
            assert gate.num_allowed == 1
            await eventually(lambda: "not signed by the plane CA" in caplog.text)
            assert outsider.num_publishers == 0
            for _ in range(20):
                await pub.publish(KV_EVENTS_TOPIC, b"secret")
            async with asyncio.timeout(10):
                for _ in range(20):
                    assert (await anext(sub)).payload == b"secret"
            assert outsider.num_pending == 0 and outsider.num_received == 0
    lines = caplog.text
    assert "plane key record" in lines and "not connecting to publisher" in lines


async def test_plain_and_curve_planes_refuse_each_other(
    store: MemoryStore, ca: TestCa, caplog: pytest.LogCaptureFixture
) -> None:
    curve = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("worker")))
    plain = ZmqEventPlane(store)
    with caplog.at_level(logging.WARNING, "turnout.runtime.event_plane"):
        async with curve, plain:
            curve_pub = await curve.publisher("dyn", "curve")
            plain_pub = await plain.publisher("dyn", "plain")
            curve_sub = await curve.subscribe("dyn", "curve", "")  # admitted, for the count
            from_curve = await plain.subscribe("dyn", "curve", "")
            from_plain = await curve.subscribe("dyn", "plain", "")
            await join(curve_pub, curve_sub)
            await eventually(lambda: caplog.text.count("not connecting to publisher") >= 2)
            assert from_curve.num_publishers == 0 and from_plain.num_publishers == 0
            for _ in range(20):
                await curve_pub.publish("load", b"x")
                await plain_pub.publish("load", b"x")
            async with asyncio.timeout(10):
                for _ in range(20):
                    await anext(curve_sub)
            assert from_curve.num_received == 0 and from_plain.num_received == 0
    assert "requires CurveZMQ" in caplog.text and "no Curve key attestation" in caplog.text


async def test_a_plane_keeps_one_key_record_and_writes_it_again_when_its_lease_is_lost(
    store: MemoryStore, ca: TestCa
) -> None:
    async with ZmqEventPlane(store, plane_tls=tls_of(ca.issue("router")), lease_ttl=0.3) as plane:
        await asyncio.gather(*(plane.subscribe("dyn", c, "") for c in ("a", "b", "c")))
        [record] = await store.get_prefix(PLANE_KEYS_ROOT)
        assert record.lease_id is not None
        await store.revoke_lease(record.lease_id)

        async def rewritten() -> bool:
            kvs = await store.get_prefix(PLANE_KEYS_ROOT)
            return len(kvs) == 1 and kvs[0].lease_id not in (None, record.lease_id)

        async with asyncio.timeout(10):
            while not await rewritten():
                await asyncio.sleep(0.01)
    assert await store.get_prefix(PLANE_KEYS_ROOT) == []


async def test_a_publisher_follows_a_bounded_number_of_key_records(
    store: MemoryStore, ca: TestCa, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zap, "MAX_PLANE_KEYS", 2)
    monkeypatch.setattr(zap, "MAX_RECORDS_PER_KEY", 2)
    a, b, c = (CurveIdentity.make(tls_of(ca.issue(f"p{i}"))).attestation for i in range(3))
    async with ZmqEventPlane(store, plane_tls=tls_of(ca.issue("worker"))) as plane:
        await plane.publisher("dyn", "backend")
        gate = plane._gate
        assert gate is not None
        # Copies of one valid attestation take one key's slot: b still gets in, c does not.
        for i in range(4):
            await store.put(f"{PLANE_KEYS_ROOT}a{i}", msgspec.json.encode(a))
        await store.put(f"{PLANE_KEYS_ROOT}b", msgspec.json.encode(b))
        await store.put(f"{PLANE_KEYS_ROOT}c", msgspec.json.encode(c))
        counts = {"past 2 records of its key": 2, "past 2 keys": 1}
        await eventually(lambda: gate.refusals.counts == counts, what="copies and c refused")
        assert gate.num_allowed == 2
        # A removed copy does not revoke a's key while another followed record names it.
        await store.delete(f"{PLANE_KEYS_ROOT}a0")
        await store.delete(f"{PLANE_KEYS_ROOT}b")
        await eventually(lambda: gate.num_allowed == 1)
        assert a.curve_key.encode() in gate._allowed
        await store.delete(f"{PLANE_KEYS_ROOT}a1")
        await eventually(lambda: gate.num_allowed == 0)


async def test_a_publisher_without_its_zap_handler_admits_no_one(
    store: MemoryStore, ca: TestCa
) -> None:
    """libzmq admits every CURVE client when no ZAP handler is bound unless the socket enforces
    its ZAP domain: the publisher's does, so a gate that is not running fails closed."""
    pub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("worker")))
    sub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("router")))
    async with pub_plane, sub_plane:
        pub = await pub_plane.publisher("dyn", "backend")
        assert pub_plane._gate is not None
        await pub_plane._gate.close()  # the ZAP endpoint unbound
        sub = await sub_plane.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
        await eventually(lambda: sub.num_publishers == 1, what="the subscriber connecting")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SILENCE_S
        while loop.time() < deadline:
            await pub.publish(KV_EVENTS_TOPIC, b"secret block hashes")
            await asyncio.sleep(0.02)
        assert sub.num_received == 0 and sub.num_pending == 0


class LateKeyStore(MemoryStore):
    """A memory store that holds back writes of plane key records until ``release`` is set,
    as a slow store would (the writer is told it is done)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self._held: list[asyncio.Task[int]] = []

    async def put(self, key: str, value: bytes, *, lease_id: int | None = None) -> int:
        if key.startswith(PLANE_KEYS_ROOT) and not self.release.is_set():
            self._held.append(asyncio.create_task(self._later(key, value, lease_id)))
            return 0
        return await super().put(key, value, lease_id=lease_id)

    async def _later(self, key: str, value: bytes, lease_id: int | None) -> int:
        await self.release.wait()
        return await super().put(key, value, lease_id=lease_id)

    async def close(self) -> None:
        for task in self._held:
            task.cancel()
        if self._held:
            await asyncio.wait(self._held)
        await super().close()


async def test_a_subscriber_refused_before_its_key_record_arrives_gets_in_later(
    ca: TestCa, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A short handshake timeout: a refused client reconnects once the server closes it.
    monkeypatch.setattr(zmq_plane, "HANDSHAKE_IVL_MS", 300)
    store = LateKeyStore()
    pub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("worker")), auth_grace=0.05)
    sub_plane = ZmqEventPlane(store, plane_tls=tls_of(ca.issue("router")))
    try:
        with caplog.at_level(logging.WARNING, "turnout.runtime.event_plane.zap"):
            async with pub_plane, sub_plane:
                pub = await pub_plane.publisher("dyn", "backend")
                sub = await sub_plane.subscribe("dyn", "backend", KV_EVENTS_TOPIC)
                gate = pub_plane._gate
                assert gate is not None
                await eventually(lambda: gate.refusals.num_refused >= 1, what="a first refusal")
                assert sub.num_received == 0
                store.release.set()
                await join(pub, sub)
                assert gate.num_allowed == 1
        assert "has no verified record" in caplog.text
    finally:
        await store.close()


# --- attestations and the refusal log, without sockets --------------------------------------


def _leaf_with_key(
    ca: TestCa, tmp_path: Path, name: str, key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey
) -> Leaf:
    """A leaf signed by ``ca`` for a key of another type than TestCa's own EC keys."""
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(ca._key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Leaf(str(cert_path), str(key_path), str(ca.ca_path))


@pytest.mark.parametrize("kind", ["ec", "rsa", "ed25519"])
def test_attestations_of_every_key_type_verify(ca: TestCa, tmp_path: Path, kind: str) -> None:
    if kind == "ec":
        leaf = ca.issue("p")
    elif kind == "rsa":
        leaf = _leaf_with_key(ca, tmp_path, "p", rsa.generate_private_key(65537, 2048))
    else:
        leaf = _leaf_with_key(ca, tmp_path, "p", ed25519.Ed25519PrivateKey.generate())
    identity = CurveIdentity.make(tls_of(leaf))
    assert zmq.curve_public(identity.secret_key) == identity.public_key
    assert AttestationVerifier(leaf.ca).check(identity.attestation) is None


def test_forged_and_expired_attestations_are_refused(ca: TestCa, tmp_path: Path) -> None:
    leaf = ca.issue("p", valid_days=1)
    good = CurveIdentity.make(tls_of(leaf)).attestation
    other = CurveIdentity.make(tls_of(ca.issue("q"))).attestation
    now = datetime.datetime.now(datetime.UTC).timestamp()
    verifier = AttestationVerifier(leaf.ca, clock=lambda: now)
    swapped_key = Attestation(good.cert, other.curve_key, good.signature)
    assert "not signed by certificate" in (verifier.check(swapped_key) or "")
    borrowed_cert = Attestation(other.cert, good.curve_key, good.signature)
    assert "not signed by certificate" in (verifier.check(borrowed_cert) or "")
    stranger = CurveIdentity.make(tls_of(TestCa(tmp_path, "x").issue("p"))).attestation
    assert "not signed by the plane CA" in (verifier.check(stranger) or "")
    assert verifier.check(good) is None  # now cached...
    later = AttestationVerifier(leaf.ca, clock=lambda: now + 2 * 86400)
    assert "validity period" in (later.check(good) or "")
    verifier._clock = lambda: now + 2 * 86400  # ...until its certificate expires
    assert "validity period" in (verifier.check(good) or "")


def test_subscriber_decisions_on_publisher_records(ca: TestCa) -> None:
    creds = CurveCredentials.load(tls_of(ca.issue("p")))
    attestation = creds.identity.attestation
    assert check_publisher(None, None) == (None, None)
    assert check_publisher(attestation, None).refused is not None
    assert check_publisher(None, creds).refused is not None
    assert check_publisher(attestation, creds) == (attestation.curve_key.encode(), None)
