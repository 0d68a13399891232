"""asyncio's log, kept to what an operator can act on.

nats-py upgrades its connection to TLS with ``loop.start_tls`` under a fresh
``asyncio.StreamReaderProtocol``. ``start_tls`` never calls that protocol's
``connection_made``, so the protocol believes it runs over plain TCP and its ``eof_received``
returns True when the server closes the connection. A TLS transport ignores that value (a TLS
connection cannot stay half-open), and asyncio and uvloop alike say so with a warning,
"returning true from eof_received() has no effect when using ssl", at every disconnect of a
NATS server under TLS: nothing is wrong, and nothing can be done about it. turnout's own
protocols (the tcp request plane's connections, the HTTP server's) return None from
``eof_received``, so they never cause it.

``quiet_asyncio`` drops exactly that message from the ``asyncio`` logger; every other asyncio
warning still shows. Every command installs it (``cli.lifecycle.run_command``).
"""

from __future__ import annotations

import logging

__all__ = ["SSL_EOF_MESSAGE", "SslEofFilter", "quiet_asyncio"]

#: The warning asyncio (``sslproto``) and uvloop log, word for word.
SSL_EOF_MESSAGE = "returning true from eof_received() has no effect when using ssl"


class SslEofFilter(logging.Filter):
    """Drops ``SSL_EOF_MESSAGE`` (see the module docstring), and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != SSL_EOF_MESSAGE


def quiet_asyncio() -> None:
    """Install ``SslEofFilter`` on the ``asyncio`` logger, once."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, SslEofFilter) for f in logger.filters):
        logger.addFilter(SslEofFilter())
