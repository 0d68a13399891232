"""The key ring (``--api-key``, ``--api-keys-file``), JWT verification and the authenticator,
without HTTP: strict parsing, lookups, reloads."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import pytest
from tests.frontend.jwt_issuer import JwtIssuer

from turnout.errors import ConfigError
from turnout.frontend.access.accounting import request_priority
from turnout.frontend.access.authenticator import Authenticator
from turnout.frontend.access.jwt import JwtConfig
from turnout.frontend.access.keys import DEFAULT_TENANT, key_id_of, load_key_ring
from turnout.frontend.access.principal import TenantPolicy
from turnout.frontend.http.errors import HttpError
from turnout.runtime.http import Headers

KEY_A = "sk-turnout-test-alpha-0001"
KEY_B = "sk-turnout-test-beta-0002"
KEY_ADMIN = "sk-turnout-test-admin-0003"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return str(path)


def test_plain_keys_and_file_entries(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
[[keys]]
key = "{KEY_A}"
tenant = "team-a"
rps = 5
max_concurrent = 2

[[keys]]
sha256 = "{sha(KEY_ADMIN)}"
tenant = "ops"
admin = true
priority = 3
""",
    )
    ring = load_key_ring([KEY_B], path)
    a = ring.lookup(KEY_A)
    assert a is not None and a.tenant == "team-a" and not a.admin
    assert a.policy == TenantPolicy(rps=5.0, max_concurrent=2)
    admin = ring.lookup(KEY_ADMIN)
    assert admin is not None and admin.admin and admin.policy.priority == 3
    b = ring.lookup(KEY_B)
    assert b is not None and b.tenant == DEFAULT_TENANT and not b.admin
    assert ring.lookup("sk-turnout-test-unknown") is None
    # key_id names the key by its digest, never the key itself.
    assert a.key_id == key_id_of(hashlib.sha256(KEY_A.encode()).digest())
    assert KEY_A not in repr(ring) and KEY_A not in a.key_id


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('key = "k"\ntenant = "t"\ncolour = "red"', r"keys\[0\]\.colour: unknown field"),
        ('tenant = "t"', r"keys\[0\]: give exactly one of 'key' and 'sha256'"),
        (f'key = "k"\nsha256 = "{"0" * 64}"\ntenant = "t"', "exactly one"),
        ('sha256 = "abc"\ntenant = "t"', r"keys\[0\]\.sha256: must be the 64 hex digits"),
        ('key = "k"', r"keys\[0\]\.tenant: missing"),
        ('key = "k"\ntenant = "a b"', r"keys\[0\]\.tenant: must be a string"),
        ('key = "k"\ntenant = "t"\nadmin = "yes"', r"keys\[0\]\.admin: must be true or false"),
        ('key = "k"\ntenant = "t"\nrps = 0', r"keys\[0\]\.rps: must be a positive number"),
        ('key = "k"\ntenant = "t"\nrps = true', r"keys\[0\]\.rps"),
        ('key = "k"\ntenant = "t"\nmax_concurrent = 1.5', r"max_concurrent: must be an integer"),
        ('key = "k"\ntenant = "t"\npriority = "high"', r"keys\[0\]\.priority"),
        ('key = 5\ntenant = "t"', r"keys\[0\]\.key: must be a non-empty string"),
    ],
)
def test_strict_parsing_names_file_entry_and_field(
    tmp_path: Path, entry: str, message: str
) -> None:
    path = write(tmp_path, f"[[keys]]\n{entry}\n")
    with pytest.raises(ConfigError, match=message) as caught:
        load_key_ring((), path)
    assert path in str(caught.value)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        load_key_ring((), str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_key_ring((), write(tmp_path, "[[keys]\n"))
    with pytest.raises(ConfigError, match="unknown top-level"):
        load_key_ring((), write(tmp_path, "version = 1\n"))
    twice = f'[[keys]]\nkey = "{KEY_A}"\ntenant = "a"\n[[keys]]\nkey = "{KEY_A}"\ntenant = "b"\n'
    with pytest.raises(ConfigError, match=r"keys\[1\]: the same key is listed twice"):
        load_key_ring((), write(tmp_path, twice))
    clash = (
        f'[[keys]]\nkey = "{KEY_A}"\ntenant = "a"\nrps = 1\n'
        f'[[keys]]\nkey = "{KEY_B}"\ntenant = "a"\nrps = 2\n'
    )
    with pytest.raises(ConfigError, match=r"keys\[1\]\.rps: tenant 'a' has rps"):
        load_key_ring((), write(tmp_path, clash))


def test_tenant_limits_on_one_key_apply_to_all(tmp_path: Path) -> None:
    text = (
        f'[[keys]]\nkey = "{KEY_A}"\ntenant = "a"\nrps = 1\n'
        f'[[keys]]\nkey = "{KEY_B}"\ntenant = "a"\ntokens_per_minute = 100\n'
    )
    ring = load_key_ring((), write(tmp_path, text))
    for key in (KEY_A, KEY_B):
        principal = ring.lookup(key)
        assert principal is not None
        assert principal.policy == TenantPolicy(rps=1.0, tokens_per_minute=100.0)


def headers(**pairs: str) -> Headers:
    return Headers((name.replace("_", "-"), value) for name, value in pairs.items())


def test_authenticator_reads_bearer_and_x_api_key(tmp_path: Path) -> None:
    auth = Authenticator([KEY_A])
    assert auth.authenticate(headers(authorization=f"Bearer {KEY_A}")).tenant == DEFAULT_TENANT
    assert auth.authenticate(headers(authorization=f"bearer  {KEY_A}")).tenant == DEFAULT_TENANT
    assert auth.authenticate(headers(x_api_key=KEY_A)).tenant == DEFAULT_TENANT
    for bad in (headers(), headers(authorization="Basic abc"), headers(x_api_key="")):
        with pytest.raises(HttpError, match="missing API key") as caught:
            auth.authenticate(bad)
        assert caught.value.status == 401
        assert ("www-authenticate", 'Bearer realm="turnout"') in caught.value.headers
    with pytest.raises(HttpError, match="invalid API key") as caught:
        auth.authenticate(headers(authorization=f"Bearer {KEY_B}"))
    assert KEY_B not in caught.value.message and KEY_B not in caught.value.body().decode()


def test_reload_swaps_the_ring_and_keeps_it_on_a_bad_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, f'[[keys]]\nkey = "{KEY_A}"\ntenant = "a"\n')
    auth = Authenticator((), path)
    held = auth.authenticate(headers(x_api_key=KEY_A))
    Path(path).write_text(f'[[keys]]\nkey = "{KEY_B}"\ntenant = "b"\n')
    assert auth.reload()
    assert auth.authenticate(headers(x_api_key=KEY_B)).tenant == "b"
    with pytest.raises(HttpError):
        auth.authenticate(headers(x_api_key=KEY_A))
    assert held.tenant == "a"  # a request admitted before keeps its principal
    Path(path).write_text("[[keys]]\nkey = 1\n")
    with caplog.at_level(logging.ERROR, logger="turnout.frontend.auth"):
        assert not auth.reload()
    (error,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "previous keys stay in use" in error.getMessage()
    assert auth.authenticate(headers(x_api_key=KEY_B)).tenant == "b"


@pytest.mark.parametrize(
    ("asked", "ceiling", "authenticated", "expected"),
    [
        (None, None, False, 0),
        (4, None, False, 4),  # an open frontend: the request's own
        (4, None, True, 0),  # a tenant the operator did not rank: no higher than 0
        (2**62, None, True, 0),
        (-3, None, True, -3),
        (None, 2, True, 2),
        (5, 2, True, 2),
        (-1, 2, True, -1),
        (0, 3, True, 0),
    ],
)
def test_request_priority(
    asked: int | None, ceiling: int | None, authenticated: bool, expected: int
) -> None:
    policy = TenantPolicy(priority=ceiling)
    assert request_priority(asked, policy, authenticated=authenticated) == expected


def test_jwt_accepted_and_mapped(tmp_path: Path) -> None:
    issuer = JwtIssuer(tmp_path)
    config = JwtConfig(
        issuer=issuer.issuer, audience="turnout", jwks_file=issuer.jwks_file, admin_claim="admin"
    )
    limits = f'[[keys]]\nkey = "{KEY_A}"\ntenant = "team-j"\nrps = 7\n'
    auth = Authenticator((), write(tmp_path, limits), config)
    principal = auth.authenticate(
        headers(authorization=f"Bearer {issuer.token(tenant='team-j', sub='alice')}")
    )
    assert principal.tenant == "team-j" and principal.key_id == "jwt:alice"
    assert principal.policy.rps == 7.0 and not principal.admin
    admin = auth.authenticate(headers(authorization=f"Bearer {issuer.token(admin=True)}"))
    assert admin.admin


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        ({"iss": "https://other.example"}, "issuer"),
        ({"aud": "someone-else"}, "audience"),
        ({"exp": time.time() - 3600}, "expired"),
        ({"tenant": "no spaces allowed"}, "claim names no valid tenant"),
        ({"exp": None}, "not valid"),
        ({"exp": 10**400}, "not a finite number"),
    ],
)
def test_jwt_refused(tmp_path: Path, claims: dict[str, object], message: str) -> None:
    issuer = JwtIssuer(tmp_path)
    config = JwtConfig(issuer=issuer.issuer, audience="turnout", jwks_file=issuer.jwks_file)
    auth = Authenticator((), None, config)
    with pytest.raises(HttpError, match=message) as caught:
        auth.authenticate(headers(authorization=f"Bearer {issuer.token(**claims)}"))
    assert caught.value.status == 401


def test_jwt_with_an_exp_out_of_a_floats_range_is_refused(tmp_path: Path) -> None:
    """``"exp": 1e400`` reads as Infinity: refused, not a server error."""
    issuer = JwtIssuer(tmp_path)
    config = JwtConfig(issuer=issuer.issuer, audience="turnout", jwks_file=issuer.jwks_file)
    auth = Authenticator((), None, config)
    payload = (
        f'{{"iss": "{issuer.issuer}", "aud": "turnout", "sub": "alice", "tenant": "team-j", '
        '"exp": 1e400}'
    ).encode()
    with pytest.raises(HttpError, match="not valid") as caught:
        auth.authenticate(headers(authorization=f"Bearer {issuer.signed(payload)}"))
    assert caught.value.status == 401


def test_jwt_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    trusted = JwtIssuer(tmp_path / "trusted")
    other = JwtIssuer(tmp_path / "other")
    config = JwtConfig(issuer=trusted.issuer, audience="turnout", jwks_file=trusted.jwks_file)
    auth = Authenticator((), None, config)
    with pytest.raises(HttpError, match=r"not valid|signing key") as caught:
        auth.authenticate(headers(authorization=f"Bearer {other.token()}"))
    assert caught.value.status == 401
    forged = other.token(kid=trusted.kid)
    with pytest.raises(HttpError, match="not valid"):
        auth.authenticate(headers(authorization=f"Bearer {forged}"))


def test_jwks_file_must_hold_public_keys(tmp_path: Path) -> None:
    path = tmp_path / "jwks.json"
    path.write_text('{"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "s"}]}')
    config = JwtConfig(issuer="i", audience="a", jwks_file=str(path))
    with pytest.raises(ConfigError, match="only public keys"):
        Authenticator((), None, config)
