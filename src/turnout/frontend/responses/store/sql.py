"""The tables of the SQL backends (SQLite and PostgreSQL), one schema for both.

::

    turnout_responses           (tenant, id) -> expires_at, data
    turnout_conversations       (tenant, id) -> expires_at, data
    turnout_conversation_items  (tenant, conversation_id, item_id) -> seq, data

``tenant`` (``''``: the ``default`` tenant, see ``base``) leads every key, so scoping a lookup
by tenant costs nothing. ``seq`` orders a conversation's items (SQLite: the rowid;
PostgreSQL: a sequence): it only grows, so items come back in the order they were added,
whichever frontend added them. ``expires_at`` is indexed for the sweep.
"""

from __future__ import annotations

#: Tables, with the SQL types that differ between the backends as ``{real}`` / ``{blob}`` /
#: ``{seq}`` (see ``schema``).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS turnout_responses (
    tenant TEXT NOT NULL DEFAULT '',
    id TEXT NOT NULL,
    expires_at {real} NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS turnout_responses_expiry ON turnout_responses (expires_at);
CREATE TABLE IF NOT EXISTS turnout_conversations (
    tenant TEXT NOT NULL DEFAULT '',
    id TEXT NOT NULL,
    expires_at {real} NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS turnout_conversations_expiry ON turnout_conversations (expires_at);
CREATE TABLE IF NOT EXISTS turnout_conversation_items (
    tenant TEXT NOT NULL DEFAULT '',
    conversation_id TEXT NOT NULL,
    item_id TEXT NOT NULL,{seq}
    data {blob} NOT NULL,
    PRIMARY KEY (tenant, conversation_id, item_id)
);
"""

#: The items' ordering index (PostgreSQL's; SQLite orders by rowid, which needs none).
ITEMS_ORDER_INDEX = (
    "CREATE INDEX IF NOT EXISTS turnout_conversation_items_order "
    "ON turnout_conversation_items (tenant, conversation_id, seq)"
)


def schema(*, postgres: bool) -> list[str]:
    """The schema's statements for one backend."""
    text = _SCHEMA.format(
        real="DOUBLE PRECISION" if postgres else "REAL",
        blob="BYTEA" if postgres else "BLOB",
        seq="\n    seq BIGSERIAL NOT NULL," if postgres else "",
    )
    statements = [s.strip() for s in text.split(";") if s.strip()]
    if postgres:
        statements.append(ITEMS_ORDER_INDEX)
    return statements
