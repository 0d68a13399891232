"""What a log line may say about secrets and user content.

No line at info level or above carries a secret or what a user sent:

- a key or token is named by ``secret_id``: the first hex digits of its SHA-256, the same id
  the key ring and the audit log use, so a line can be matched to a key without showing it;
- a URL keeps its scheme, host and user, never its password or token (``redact_url``);
- a prompt, a completion or a request body is reported by its size (``describe_content``).

Content itself goes only to the ``turnout.prompts`` logger, at debug level, and only after
``enable_prompt_logging`` (the ``--log-prompts`` flag, for debugging): that logger is off at
import, so ``--log-level debug`` alone does not show prompts, and a library user who turns
on debug logging does not get them either.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sized

#: The logger that carries prompts and request bodies; silent unless enabled.
PROMPT_LOGGER = "turnout.prompts"
#: Hex digits of a secret's SHA-256 that name it in logs (the key ring's ``key_id`` length).
SECRET_ID_DIGITS = 12

prompt_log = logging.getLogger(PROMPT_LOGGER)
_OFF = logging.CRITICAL + 1
prompt_log.setLevel(_OFF)

# ``scheme://user:password@`` and ``scheme://token@``: everything between ``//`` and the
# last ``@`` before the next whitespace or ``//``, because a password may hold a raw ``/`` or
# ``@`` (``redis://:pa/ss@h``, ``u:p@ss@h``). A path holding ``@`` (``http://h/a@b``) is
# hidden as well: a host shown too little is safer than a password shown at all.
_USERINFO = re.compile(r"(?P<head>//)(?P<userinfo>(?:(?!//)\S)*)@")
# ``?password=...`` in a query, ``password=... host=...`` in a libpq key=value DSN.
_SECRET_PARAM = re.compile(
    r"(?i)\b(?P<name>password|passwd|pwd|token|secret|api_?key|sslpassword)="
    r"(?P<value>'(?:[^'\\]|\\.)*'|[^&\s]+)"
)


def secret_id(secret: str | bytes) -> str:
    """A short, stable name for ``secret`` fit for logs: a prefix of its SHA-256 in hex."""
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).hexdigest()[:SECRET_ID_DIGITS]


def _redact_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    # ``nats://token@host`` puts a token where a user would be: hide a lone one as well.
    shown = f"{user}:***" if colon else "***"
    return f"{match['head']}{shown}@"


def redact_url(url: str) -> str:
    """``url`` (or a text holding URLs, or a libpq ``key=value`` DSN) with each password
    replaced by ``***``: ``nats://u:***@h:4222``, ``?password=***``, ``password=*** host=h``.
    A lone user-info part, which NATS reads as a token, becomes ``***``."""
    return _SECRET_PARAM.sub(r"\g<name>=***", _USERINFO.sub(_redact_userinfo, url))


def describe_content(content: object) -> str:
    """``content`` by size only: ``<12 chars>``, ``<40 bytes>``, ``<7 items>``."""
    if isinstance(content, str):
        return f"<{len(content)} chars>"
    if isinstance(content, (bytes, bytearray, memoryview)):
        return f"<{len(content)} bytes>"
    if isinstance(content, Sized):
        return f"<{len(content)} items>"
    return f"<{type(content).__name__}>"


def enable_prompt_logging() -> None:
    """Let ``log_prompt`` lines through at debug level, whatever ``--log-level`` says, and
    say so once at warning level: prompts in logs must never be a surprise."""
    prompt_log.setLevel(logging.DEBUG)
    prompt_log.warning(
        "--log-prompts is on: prompts and request bodies are logged at debug level; "
        "turn it off outside debugging"
    )


def disable_prompt_logging() -> None:
    """Silence ``log_prompt`` (its state at import)."""
    prompt_log.setLevel(_OFF)


def prompt_logging_enabled() -> bool:
    return prompt_log.isEnabledFor(logging.DEBUG)


def log_prompt(what: str, request_id: str, content: object) -> None:
    """Log ``content`` (a body, a prompt, a decoded request) of request ``request_id`` on
    the prompt logger at debug level; nothing at all, not even its formatting, when
    prompt logging is off."""
    if prompt_log.isEnabledFor(logging.DEBUG):
        if isinstance(content, (bytes, bytearray, memoryview)):
            content = bytes(content).decode("utf-8", errors="replace")
        prompt_log.debug("request %s %s: %s", request_id, what, content)
