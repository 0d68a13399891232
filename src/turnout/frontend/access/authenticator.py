"""Who a request speaks for: its credential, from its headers, checked against the key ring
and (optionally) as a JWT.

The credential is ``Authorization: Bearer <token>`` (OpenAI's clients) or ``x-api-key``
(Anthropic's). A token is looked up as an API key first (one SHA-256 and a dict lookup); when
it is no key and JWTs are configured, a token shaped like one (three dot-separated parts) is
verified as a JWT, whose tenant gets the policy the key ring gives that tenant. A missing,
unknown or invalid credential is a 401 with ``WWW-Authenticate: Bearer``; its message says
which, never the credential.

``reload`` (on ``SIGHUP``) reads the keys file and the JWKS file again and swaps the ring in
one assignment: requests already admitted keep their principal, the next ones see the new
ring (a revoked key is refused from then on). A file that does not load leaves the old ring
(and keys) in place, with one error line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from turnout.errors import ConfigError
from turnout.frontend.access.jwt import InvalidToken, JwtConfig, JwtVerifier
from turnout.frontend.access.keys import KeyRing, load_key_ring
from turnout.frontend.access.principal import Principal
from turnout.frontend.http.errors import HttpError
from turnout.runtime.http import Headers

log = logging.getLogger("turnout.frontend.auth")

#: The error ``code`` of a 401 (OpenAI's), and of a 403 on a control route.
UNAUTHENTICATED_CODE = "invalid_api_key"
FORBIDDEN_CODE = "admin_key_required"
_CHALLENGE = [("www-authenticate", 'Bearer realm="turnout"')]
_INVALID_CHALLENGE = [("www-authenticate", 'Bearer realm="turnout", error="invalid_token"')]


class Authenticator:
    """Maps a request's headers to its ``Principal``; see the module's docstring.

    ``keys``: the ``--api-key`` values; ``keys_file``: ``--api-keys-file``; ``jwt``: the
    ``--jwt-*`` flags. Raises ``ConfigError`` at construction when a file does not load.
    """

    def __init__(
        self,
        keys: Sequence[str] = (),
        keys_file: str | None = None,
        jwt: JwtConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys = tuple(keys)
        self._keys_file = keys_file
        #: The ring of the moment; replaced whole by ``reload``.
        self.ring: KeyRing = load_key_ring(self._keys, keys_file)
        self._jwt = JwtVerifier(jwt, clock) if jwt is not None else None

    def describe(self) -> str:
        """What the authenticator accepts, for the start-up log line (no key in it)."""
        parts = [f"{len(self.ring)} API key(s) of {len(self.ring.policies)} tenant(s)"]
        if self._jwt is not None:
            parts.append(f"JWTs of issuer {self._jwt.config.issuer}")
        return ", ".join(parts)

    def authenticate(self, headers: Headers) -> Principal:
        """The principal of the request's credential; a 401 ``HttpError`` when it has none
        or an invalid one."""
        token = _credential(headers)
        if token is None:
            raise HttpError(
                401,
                "missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key'",
                code=UNAUTHENTICATED_CODE,
                headers=_CHALLENGE,
            )
        principal = self.ring.lookup(token)
        if principal is not None:
            return principal
        verifier = self._jwt
        if verifier is not None and token.count(".") == 2:
            try:
                identity = verifier.verify(token)
            except InvalidToken as exc:
                raise HttpError(
                    401, str(exc), code=UNAUTHENTICATED_CODE, headers=_INVALID_CHALLENGE
                ) from None
            return Principal(
                tenant=identity.tenant,
                key_id=identity.key_id,
                admin=identity.admin,
                policy=self.ring.policy_of(identity.tenant),
            )
        raise HttpError(
            401, "invalid API key", code=UNAUTHENTICATED_CODE, headers=_INVALID_CHALLENGE
        )

    def reload(self) -> bool:
        """Read the keys file (and the JWKS file) again; True when the new ones are in use.
        A file that does not load keeps the old ring and keys, and says why in one line."""
        try:
            ring = load_key_ring(self._keys, self._keys_file)
            if self._jwt is not None:
                self._jwt.reload()
        except ConfigError as exc:
            log.error("reload refused, the previous keys stay in use: %s", exc)
            return False
        self.ring = ring
        log.info("credentials reloaded: %s", self.describe())
        return True


def require_admin(principal: Principal) -> None:
    """A 403 unless ``principal`` holds an admin key."""
    if not principal.admin:
        raise HttpError(403, "this route needs an admin key", code=FORBIDDEN_CODE)


def _credential(headers: Headers) -> str | None:
    """The bearer token, else the ``x-api-key`` value; None when the request has neither."""
    authorization = headers.get("authorization")
    if authorization:
        if authorization.startswith("Bearer "):  # as every client spells it: no split
            token = authorization[7:].strip()
            if token:
                return token
        else:
            scheme, _, token = authorization.partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and token:
                return token
    key = headers.get("x-api-key")
    return key or None
