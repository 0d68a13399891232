"""A test identity provider: an EC key pair, its JWKS file, and tokens it signs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

ISSUER = "https://idp.test.example"


class JwtIssuer:
    """Writes ``directory/jwks.json`` with its public key; ``token`` signs claims (ES256)."""

    def __init__(self, directory: Path, kid: str = "k1", issuer: str = ISSUER) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.kid = kid
        self.issuer = issuer
        self._key = ec.generate_private_key(ec.SECP256R1())
        public = json.loads(ECAlgorithm.to_jwk(self._key.public_key()))
        public.update(kid=kid, alg="ES256", use="sig")
        path = directory / "jwks.json"
        path.write_text(json.dumps({"keys": [public]}))
        self.jwks_file = str(path)

    def token(self, *, kid: str | None = None, **claims: Any) -> str:
        """A token for tenant ``team-j`` of subject ``alice``, valid for an hour, with
        ``claims`` over those (a claim given as None is left out)."""
        now = time.time()
        body: dict[str, Any] = {
            "iss": self.issuer,
            "aud": "turnout",
            "sub": "alice",
            "tenant": "team-j",
            "iat": int(now),
            "exp": int(now + 3600),
        }
        body.update(claims)
        body = {name: value for name, value in body.items() if value is not None}
        return jwt.encode(body, self._key, algorithm="ES256", headers={"kid": kid or self.kid})

    def signed(self, payload: bytes) -> str:
        """A token of exactly ``payload`` (JSON text that ``token`` could not write, such as
        a number out of a float's range), signed with this issuer's key."""
        return jwt.api_jws.encode(payload, self._key, algorithm="ES256", headers={"kid": self.kid})
