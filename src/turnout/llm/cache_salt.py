"""A request's cache salt: the block space its prompt hashes into (``protocols.block_hashing``
seeds the hashes with it, engines partition their prefix caches by it, the KV router credits a
worker only with blocks of the same space).

Two things choose it. The client may send one (``cache_salt`` or ``nvext.cache_salt``), to
keep its own prompts apart. The frontend puts each tenant in its own space, so that no tenant
is served, or can time, another's cached prefix: ``tenant_cache_salt`` joins the tenant's
name and the client's salt into one string. The tenant's name goes first with its length, so
no (tenant, salt) pair spells another's; it starts with ``TENANT_SALT_PREFIX``, a prefix a
client's own salt may not take, so no client of the un-tenanted space (no tenant, or a tenant
that shares it: ``--shared-cache-tenants``) can name a tenant's space either.

A salt is kept only by an engine that partitions its prefix cache by it (the card's
``capabilities.cache_salt``): ``request_cache_salt`` (``fields_cache_salt`` for a text
model's relayed body) refuses a salted request to any other model before it is routed, with a
message that says whose salt it is (the client's, or its tenant's), rather than the worker's
refusal of a field the client may never have sent.
"""

from __future__ import annotations

from turnout.errors import RequestError
from turnout.protocols.model import ModelDeploymentCard
from turnout.protocols.openai import ChatCompletionRequest, CompletionRequest

#: Longest cache salt a client may send (a tenant id or a random token, not a document).
MAX_CACHE_SALT_CHARS = 256
#: How every tenant's salt starts; refused at the start of a client's salt.
TENANT_SALT_PREFIX = "\x00tenant:"


def tenant_cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The salt of a request by ``tenant`` (None: the un-tenanted space) that asked for
    ``salt`` (None: none)."""
    if tenant is None:
        return salt
    space = f"{TENANT_SALT_PREFIX}{len(tenant)}:{tenant}"
    return space if salt is None else f"{space}:{salt}"


def client_cache_salt(top: str | None, ext: str | None) -> str | None:
    """A client's cache salt from ``cache_salt`` (``top``) or ``nvext.cache_salt`` (``ext``),
    equal if both; ``RequestError`` for an empty one, one past ``MAX_CACHE_SALT_CHARS``, or
    one that starts like a tenant's."""
    if top is not None and ext is not None and top != ext:
        raise RequestError(
            "'cache_salt' and 'nvext.cache_salt' differ; give one", param="cache_salt"
        )
    salt = top if top is not None else ext
    if salt is None:
        return None
    param = "cache_salt" if top is not None else "nvext.cache_salt"
    if not salt:
        raise RequestError(f"'{param}' must not be empty", param=param)
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise RequestError(
            f"'{param}' is longer than {MAX_CACHE_SALT_CHARS} characters", param=param
        )
    if salt.startswith(TENANT_SALT_PREFIX):
        raise RequestError(
            f"'{param}' must not start with {TENANT_SALT_PREFIX!r} (tenants' cache spaces)",
            param=param,
        )
    return salt


def request_cache_salt(
    req: ChatCompletionRequest | CompletionRequest,
    tenant: str | None,
    card: ModelDeploymentCard,
) -> str | None:
    """The salt of ``req`` by ``tenant`` to the model of ``card`` (``fields_cache_salt`` of
    its two fields)."""
    ext = req.nvext.cache_salt if req.nvext is not None else None
    return fields_cache_salt(req.cache_salt, ext, tenant, card)


def fields_cache_salt(
    top: str | None, ext: str | None, tenant: str | None, card: ModelDeploymentCard
) -> str | None:
    """The salt of a request by ``tenant`` that sent ``cache_salt`` ``top`` and
    ``nvext.cache_salt`` ``ext``, to the model of ``card`` (``tenant_cache_salt``).
    ``RequestError`` for a client's salt that ``client_cache_salt`` refuses, and for any
    salt to a model whose engine cannot partition its cache: naming the client's field when
    it sent one, else saying the tenant's space cannot be kept (no tenant is named: the
    caller's own tenant is the operator's label, and the message goes to the client).
    It takes the fields, not a request, for a text model's relayed body too, which the
    frontend does not parse into a request."""
    salt = client_cache_salt(top, ext)
    if card.capabilities.cache_salt or (salt is None and tenant is None):
        return tenant_cache_salt(tenant, salt)
    model = card.display_name
    if salt is not None:
        param = "cache_salt" if top is not None else "nvext.cache_salt"
        raise RequestError(
            f"model '{model}' cannot honour '{param}' (its engine cannot partition its "
            "prefix cache)",
            param=param,
        )
    raise RequestError(
        f"model '{model}' cannot serve your tenant: its engine cannot keep "
        "tenants' prefix caches apart. An operator can let the tenant share the common cache "
        "by naming it in --shared-cache-tenants.",
        param="model",
    )
