"""A process's credentials on the planes between turnout processes.

One deployment CA signs every process's certificate; each process holds its own certificate
and key (PEM files: ``--plane-ca``, ``--plane-cert``, ``--plane-key``). With them, the tcp
request plane runs mutual TLS (both ends show a certificate the CA signed) and the zmq event
plane runs CurveZMQ with keys bound to those certificates, so a peer that cannot show one is
refused at the handshake. Without them the planes are plain TCP, which is right on a single
machine's loopback and nowhere else.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from turnout.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PlaneTls:
    """Paths of the deployment CA's certificate, this process's certificate and its key."""

    ca: str
    cert: str
    key: str

    @classmethod
    def from_flags(cls, ca: str | None, cert: str | None, key: str | None) -> PlaneTls | None:
        """The credentials the three flags name (None: none given); ``ConfigError`` when only
        some are given or the files do not load together."""
        given = {"--plane-ca": ca, "--plane-cert": cert, "--plane-key": key}
        if not any(given.values()):
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ConfigError(f"plane TLS needs all of --plane-ca, --plane-cert, --plane-key; "
                              f"missing {', '.join(missing)}")  # fmt: skip
        assert ca is not None and cert is not None and key is not None
        tls = cls(ca, cert, key)
        tls.server_context()  # loads and checks every file now, not at the first connection
        return tls

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(purpose, cafile=self.ca)
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the plane TLS files ({self.cert}, {self.key}, "
                              f"CA {self.ca}): {exc}") from exc  # fmt: skip
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """For a plane server: it requires a client certificate signed by the CA."""
        ctx = self._context(ssl.Purpose.CLIENT_AUTH)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """For a plane client: it shows its certificate and checks the server's against the
        CA and the address it dials."""
        return self._context(ssl.Purpose.SERVER_AUTH)
