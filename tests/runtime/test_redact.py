"""What log lines may say about secrets and prompts (``turnout.runtime.redact``), and the
``--log-prompts`` flag that lets prompts through at debug level."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator

import pytest

from turnout.cli.flags import setup_logging
from turnout.cli.main import build_parser
from turnout.cli.serve import worker_argv
from turnout.errors import ConfigError
from turnout.runtime.discovery.etcd import EtcdStore
from turnout.runtime.nats import NatsOptions
from turnout.runtime.planes import PlanesConfig
from turnout.runtime.redact import (
    PROMPT_LOGGER,
    describe_content,
    disable_prompt_logging,
    enable_prompt_logging,
    log_prompt,
    prompt_logging_enabled,
    redact_url,
    secret_id,
)

SECRET = "sk-turnout-test-redact-0123456789"


@pytest.fixture(autouse=True)
def prompts_off() -> Iterator[None]:
    """Every test leaves prompt logging as it found it: off."""
    yield
    disable_prompt_logging()


def test_a_secret_is_named_by_a_prefix_of_its_digest() -> None:
    assert secret_id(SECRET) == hashlib.sha256(SECRET.encode()).hexdigest()[:12]
    assert secret_id(SECRET.encode()) == secret_id(SECRET)
    assert SECRET not in secret_id(SECRET)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:sk-turnout-test-pw@h:4222", "nats://alice:***@h:4222"),
        ("nats://sk-turnout-test-token@h:4222", "nats://***@h:4222"),
        ("https://u:p%40ss@etcd:2379", "https://u:***@etcd:2379"),
        ("nats://h:4222", "nats://h:4222"),
        ("http://127.0.0.1:2379/", "http://127.0.0.1:2379/"),
        ("a nats://u:x@h b tls://v:y@k", "a nats://u:***@h b tls://v:***@k"),
        (
            "postgresql://h/db?user=u&password=pw&sslmode=require",
            "postgresql://h/db?user=u&password=***&sslmode=require",
        ),
        ("host=h password='a b\\'c' dbname=x", "host=h password=*** dbname=x"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://:sk-turnout-test-pa/ss@h:6379/0", "redis://:***@h:6379/0"),
        ("nats://u:sk-turnout-test-p@ss@h:4222", "nats://u:***@h:4222"),
        ("nats://u:x@h1,nats://v:y@h2", "nats://u:***@h1,nats://v:***@h2"),
    ],
)
def test_urls_keep_their_user_but_not_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("content", "shown"),
    [("héllo", "<5 chars>"), (b"{}", "<2 bytes>"), ([1, 2, 3], "<3 items>"), (7, "<int>")],
)
def test_content_is_described_by_its_size(content: object, shown: str) -> None:
    assert describe_content(content) == shown


def test_prompts_stay_out_of_the_logs_even_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    log_prompt("body", "req-1", b'{"prompt": "the secret plan"}')
    assert not prompt_logging_enabled()
    assert "secret plan" not in caplog.text


def test_log_prompts_logs_them_at_debug_after_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert not logging.getLogger().isEnabledFor(logging.DEBUG)  # prompts come through anyway
    enable_prompt_logging()
    log_prompt("body", "req-1", b'{"prompt": "the secret plan"}')
    warning, line = caplog.records
    assert warning.levelno == logging.WARNING and "--log-prompts is on" in warning.message
    assert line.name == PROMPT_LOGGER and line.levelno == logging.DEBUG
    assert line.message == 'request req-1 body: {"prompt": "the secret plan"}'


def test_setup_logging_follows_the_flag() -> None:
    setup_logging("info", log_prompts=True)
    assert prompt_logging_enabled()
    setup_logging("debug", log_prompts=False)
    assert not prompt_logging_enabled()


@pytest.mark.parametrize("command", ["frontend", "worker", "router", "attach"])
def test_every_process_takes_log_prompts(command: str) -> None:
    required = {"worker": ["--engine", "echo"], "attach": ["--url", "http://127.0.0.1:1"]}
    argv = [command, *required.get(command, []), "--log-prompts"]
    assert build_parser().parse_args(argv).log_prompts is True


def test_serve_passes_log_prompts_to_its_workers() -> None:
    parser = build_parser()
    on = worker_argv(parser.parse_args(["serve", "--engine", "echo", "--log-prompts"]), "/s", 1)
    off = worker_argv(parser.parse_args(["serve", "--engine", "echo"]), "/s", 1)
    assert "--log-prompts" in on and "--log-prompts" not in off


def test_configs_do_not_show_their_passwords() -> None:
    nats = NatsOptions(
        servers=[f"nats://u:{SECRET}@h:4222", f"nats://{SECRET}@k:4222"],
        password=SECRET,
        token=SECRET,
    )
    assert "nats://u:***@h:4222" in repr(nats) and "nats://***@k:4222" in repr(nats)
    planes = PlanesConfig(store="etcd", store_options={"password": SECRET}, nats=nats)
    assert SECRET not in repr(nats) and SECRET not in repr(planes)


def test_a_refused_etcd_endpoint_is_quoted_without_its_password() -> None:
    with pytest.raises(ConfigError) as caught:
        EtcdStore(endpoints=[f"http://root:{SECRET}@127.0.0.1:2379"])
    assert SECRET not in str(caught.value) and "root:***@" in str(caught.value)
