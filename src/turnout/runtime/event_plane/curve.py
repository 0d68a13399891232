"""CurveZMQ keys bound to the deployment's plane certificates.

ZeroMQ cannot run TLS; it authenticates and encrypts with CurveZMQ, whose identities are bare
Curve25519 public keys. To tie those keys to the deployment CA (``--plane-ca``), each zmq event
plane with plane credentials makes a Curve key pair and an ``Attestation`` of its public key:
its plane certificate, the key, and a signature over ``ATTESTATION_LABEL + key`` made with the
plane private key. Anyone can check an attestation with the CA's certificate alone
(``AttestationVerifier``): the certificate must be signed directly by the CA and be within its
validity period, and the signature must check with the certificate's public key.

Attestations travel through the discovery store (publishers' records, subscribers' key records,
see ``zap``). The store is not trusted: a copied attestation is of no use without the Curve
secret key, which never leaves the process, and a forged one does not verify.

The key pair is made at random per plane, not derived from the plane key: the attestation
already binds it to the certificate, so a derivation would add nothing but a second use of
the long-lived key's material. A plane that restarts attests a new key.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import zmq
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from turnout.errors import ConfigError
from turnout.runtime.plane_tls import PlaneTls

#: What an attestation's signature covers before the Curve key (a wire format: keep it stable).
ATTESTATION_LABEL = b"turnout event plane curve key v1\x00"
#: Verified attestations remembered (the least recently used are forgotten first).
VERIFIED_CACHE_SIZE = 4096


class Attestation(msgspec.Struct, frozen=True):
    """A Curve public key (Z85 text) vouched for by a plane certificate (PEM)."""

    cert: str
    curve_key: str
    signature: bytes


_attestation_decoder = msgspec.json.Decoder(Attestation)


def decode_attestation(value: bytes) -> Attestation:
    """An attestation from its JSON form; ``msgspec.DecodeError`` when it is not one."""
    return _attestation_decoder.decode(value)


def _sign(key: Any, data: bytes) -> bytes:
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise ConfigError(f"plane key type {type(key).__name__} cannot sign a CurveZMQ attestation")


def _verify(key: Any, signature: bytes, data: bytes) -> None:
    """Raises ``InvalidSignature`` (or ``TypeError`` for a key type not signed with)."""
    if isinstance(key, rsa.RSAPublicKey):
        key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ec.EllipticCurvePublicKey):
        key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, ed25519.Ed25519PublicKey):
        key.verify(signature, data)
    else:
        raise TypeError(f"unsupported certificate key type {type(key).__name__}")


@dataclass(frozen=True, slots=True)
class CurveIdentity:
    """This plane's Curve key pair (Z85) and the attestation of its public key."""

    public_key: bytes
    secret_key: bytes
    attestation: Attestation

    @classmethod
    def make(cls, tls: PlaneTls) -> CurveIdentity:
        """A fresh key pair attested with ``tls``'s certificate and key; ``ConfigError`` when
        they do not load or the key cannot sign."""
        try:
            with open(tls.cert, "rb") as f:
                cert_pem = f.read()
            with open(tls.key, "rb") as f:
                key = serialization.load_pem_private_key(f.read(), password=None)
            x509.load_pem_x509_certificate(cert_pem)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"cannot load the plane certificate and key ({tls.cert}, {tls.key}): {exc}"
            ) from exc
        public_key, secret_key = zmq.curve_keypair()
        signature = _sign(key, ATTESTATION_LABEL + public_key)
        attestation = Attestation(cert_pem.decode(), public_key.decode(), signature)
        return cls(public_key, secret_key, attestation)


class AttestationVerifier:
    """Checks attestations against the deployment CA (``ca``: a PEM file of one or more CA
    certificates); remembers up to ``VERIFIED_CACHE_SIZE`` verified ones until their
    certificate expires. ``clock`` (seconds since the epoch) is injectable for tests."""

    def __init__(self, ca: str, *, clock: Callable[[], float] = time.time) -> None:
        try:
            with open(ca, "rb") as f:
                self._cas = x509.load_pem_x509_certificates(f.read())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the plane CA {ca}: {exc}") from exc
        self._clock = clock
        #: Verified attestation -> the end of its certificate's validity (epoch seconds).
        self._verified: collections.OrderedDict[Attestation, float] = collections.OrderedDict()

    def check(self, attestation: Attestation) -> str | None:
        """None when ``attestation`` is valid now, else why not (for a log line)."""
        now = self._clock()
        until = self._verified.get(attestation)
        if until is not None:
            if now <= until:
                self._verified.move_to_end(attestation)
                return None
            del self._verified[attestation]
        try:
            cert = x509.load_pem_x509_certificate(attestation.cert.encode())
        except ValueError as exc:
            return f"unreadable certificate: {exc}"
        subject = cert.subject.rfc4514_string()
        if not any(self._issued_by(cert, ca) for ca in self._cas):
            return f"certificate {subject!r} is not signed by the plane CA"
        if not cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp():
            return f"certificate {subject!r} is outside its validity period"
        try:
            _verify(
                cert.public_key(),
                attestation.signature,
                ATTESTATION_LABEL + attestation.curve_key.encode(),
            )
        except (InvalidSignature, TypeError):
            return f"the Curve key is not signed by certificate {subject!r}"
        self._verified[attestation] = cert.not_valid_after_utc.timestamp()
        if len(self._verified) > VERIFIED_CACHE_SIZE:
            self._verified.popitem(last=False)
        return None

    @staticmethod
    def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            return False
        return True


@dataclass(frozen=True, slots=True)
class CurveCredentials:
    """What a zmq event plane with plane credentials holds: its identity and the verifier."""

    identity: CurveIdentity
    verifier: AttestationVerifier

    @classmethod
    def load(cls, tls: PlaneTls) -> CurveCredentials:
        return cls(CurveIdentity.make(tls), AttestationVerifier(tls.ca))


class PublisherCheck(NamedTuple):
    """Whether a subscriber connects to a publisher: ``refused`` says why not; otherwise
    ``server_key`` is the publisher's Curve key (Z85; None: a plain connection)."""

    server_key: bytes | None
    refused: str | None


def check_publisher(
    attestation: Attestation | None, credentials: CurveCredentials | None
) -> PublisherCheck:
    """A subscriber's decision on a publisher's record: a plain plane connects to plain
    publishers only, a plane with credentials to publishers whose attestation verifies."""
    if credentials is None:
        if attestation is None:
            return PublisherCheck(None, None)
        return PublisherCheck(None, "it requires CurveZMQ and this process has no plane TLS")
    if attestation is None:
        return PublisherCheck(None, "it has no Curve key attestation (no plane TLS)")
    why = credentials.verifier.check(attestation)
    if why is not None:
        return PublisherCheck(None, why)
    return PublisherCheck(attestation.curve_key.encode(), None)
