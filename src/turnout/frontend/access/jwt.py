"""JWT bearer tokens: signed by an identity provider whose public keys (a JWKS) are in a
local file, naming the caller's tenant in a claim.

A token is accepted when its signature checks against the JWKS key its header's ``kid``
names (the only key, when the set has one and the token names none), with that key's own
algorithm (asymmetric only: RSA, EC, EdDSA; never ``none`` or a shared secret), and its
``iss``, ``aud`` and ``exp`` claims are present and right. Nothing is fetched at run time:
the JWKS file is read at start and again on ``SIGHUP`` (key rotation).

Verifying a signature costs tens of microseconds; a verified token is remembered (a bounded
table, by the token's digest, until its ``exp``) so a client reusing its token pays once.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jwt

from turnout.errors import ConfigError
from turnout.frontend.access.keys import valid_tenant

#: Key types accepted in the JWKS file (asymmetric only).
ASYMMETRIC_KEY_TYPES = ("RSA", "EC", "OKP")
#: Verified tokens remembered (``JwtVerifier``); past it the least recently used goes.
MAX_REMEMBERED_TOKENS = 4096
#: Longest ``sub`` kept in a principal's ``key_id`` (``jwt:<sub>``).
MAX_SUBJECT_CHARS = 64


@dataclass(frozen=True, slots=True)
class JwtConfig:
    """The ``--jwt-*`` flags."""

    issuer: str
    audience: str
    jwks_file: str
    #: The claim that names the tenant.
    tenant_claim: str = "tenant"
    #: A claim that, when ``true``, makes the caller an admin (None: no token is).
    admin_claim: str | None = None
    #: Seconds of clock skew tolerated on ``exp``/``nbf``/``iat``.
    leeway: float = 30.0


@dataclass(frozen=True, slots=True)
class JwtIdentity:
    """Who a verified token names."""

    tenant: str
    #: ``jwt:<sub>`` (``Principal.key_id``).
    key_id: str
    admin: bool
    #: The token's ``exp`` (seconds since the epoch).
    expires: float


class InvalidToken(Exception):
    """A token that is not accepted; the message says why without quoting the token."""


def load_jwks(path: str) -> dict[str, jwt.PyJWK]:
    """The asymmetric keys of the JWKS file at ``path``, by ``kid`` ("" for one without)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"--jwt-jwks-file {path}: cannot read it: {exc.strerror}") from None
    try:
        keyset = jwt.PyJWKSet.from_json(text)
    except (jwt.PyJWKSetError, jwt.PyJWKError, ValueError) as exc:
        raise ConfigError(f"--jwt-jwks-file {path}: not a usable JWKS: {exc}") from None
    keys: dict[str, jwt.PyJWK] = {}
    for i, key in enumerate(keyset.keys):
        kty = key.key_type
        if kty not in ASYMMETRIC_KEY_TYPES:
            raise ConfigError(
                f"--jwt-jwks-file {path}: keys[{i}] has kty {kty!r}; only public keys "
                f"({', '.join(ASYMMETRIC_KEY_TYPES)}) are accepted"
            )
        kid = key.key_id or ""
        if kid in keys:
            raise ConfigError(f"--jwt-jwks-file {path}: two keys have kid {kid!r}")
        keys[kid] = key
    return keys


class JwtVerifier:
    """Checks bearer tokens against ``config``; ``clock``: seconds since the epoch."""

    def __init__(self, config: JwtConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._keys = load_jwks(config.jwks_file)
        self._remembered: OrderedDict[bytes, JwtIdentity] = OrderedDict()

    def reload(self) -> None:
        """Read the JWKS file again (raises ``ConfigError`` and keeps the old keys when it is
        not usable); tokens verified with the old keys are checked again."""
        keys = load_jwks(self.config.jwks_file)
        self._keys = keys
        self._remembered.clear()

    def verify(self, token: str) -> JwtIdentity:
        """Who ``token`` names; raises ``InvalidToken`` saying why it is refused."""
        digest = hashlib.sha256(token.encode()).digest()
        remembered = self._remembered.get(digest)
        now = self._clock()
        if remembered is not None:
            if remembered.expires > now - self.config.leeway:
                self._remembered.move_to_end(digest)
                return remembered
            del self._remembered[digest]
        identity = self._check(token)
        self._remembered[digest] = identity
        if len(self._remembered) > MAX_REMEMBERED_TOKENS:
            self._remembered.popitem(last=False)
        return identity

    def _check(self, token: str) -> JwtIdentity:
        config = self.config
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise InvalidToken("the bearer token is not a JWT") from None
        kid = header.get("kid")
        keys = self._keys
        if kid is None and len(keys) == 1:
            key = next(iter(keys.values()))
        elif isinstance(kid, str) and kid in keys:
            key = keys[kid]
        else:
            raise InvalidToken("the token's signing key (kid) is not in the JWKS")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key=key.key,
                algorithms=[key.algorithm_name],
                audience=config.audience,
                issuer=config.issuer,
                leeway=config.leeway,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the token has expired") from None
        except jwt.InvalidIssuerError:
            raise InvalidToken("the token's issuer is not the one expected") from None
        except jwt.InvalidAudienceError:
            raise InvalidToken("the token's audience is not this service") from None
        except jwt.InvalidTokenError as exc:
            raise InvalidToken(f"the token is not valid: {type(exc).__name__}") from None
        tenant = claims.get(config.tenant_claim)
        if not valid_tenant(tenant):
            raise InvalidToken(f"the token's {config.tenant_claim!r} claim names no valid tenant")
        assert isinstance(tenant, str)
        admin = config.admin_claim is not None and claims.get(config.admin_claim) is True
        subject = str(claims.get("sub", ""))[:MAX_SUBJECT_CHARS]
        return JwtIdentity(
            tenant=tenant, key_id=f"jwt:{subject}", admin=admin, expires=_expiry(claims["exp"])
        )


def _expiry(exp: Any) -> float:
    """``exp`` as seconds since the epoch; an integer too large for a float (``10**400``,
    which PyJWT's own check lets through) is refused instead of failing the request."""
    try:
        expires = float(exp)
    except (OverflowError, ValueError, TypeError):
        raise InvalidToken("the token is not valid: its exp is not a finite number") from None
    if not math.isfinite(expires):
        raise InvalidToken("the token is not valid: its exp is not a finite number")
    return expires
