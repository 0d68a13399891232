"""How much one request may ask for: bounds checked before any expensive step.

Every field a client sends that sizes work or memory (stop strings, stop token ids, messages,
tools, choices, the response itself) has a bound here, so a small body cannot buy a large
allocation or a long stall of the event loop. Each bound is a frontend flag
(``--max-stop-strings`` ...); a request past one gets a 400 whose ``param`` names the field
and whose message names the flag. The frontend builds one ``RequestLimits`` from its flags and
hands it to every model's preprocessor and to the surfaces that translate other APIs.

Defaults, and why:

* ``max_stop_strings`` 16, ``max_stop_string_chars`` 256: OpenAI allows 4 stops; stop lists
  of agent frameworks and model configs hold a handful of short markers (``</tool_call>``,
  ``\\nObservation:``). The jail's automaton costs O(total length) to build per request
  (16 x 256 characters: a few ms, about 1 MB, worst case).
* ``max_stop_token_ids`` 256: a model's end tokens, or its special tokens, fit many times.
* ``max_messages`` 10,000: a long agent session (each tool call and result is a message) fits;
  rendering is ~20 µs a message, so the template's work stays a fraction of a second.
* ``max_tools`` 256 and ``max_tools_chars`` 1 MiB (the tools' JSON): OpenAI allows 128
  tools; a large MCP tool set is a few hundred KB.
* ``max_choices`` 16 (``n``): each choice is a sub-request routed and run on its own.
* ``max_response_items`` 262,144: ``n x max_tokens x (1 + top_logprobs)``, the entries of the
  largest response a request may ask for. A whole (non-streamed) response is built and
  encoded at once. Measured on the mocker (2 cores): 16 x 780 x 21 = 262,080 entries make a
  22 MB body in 2 s with ``/live`` answering within 50 ms throughout; 16 x 8000 x 21 (a
  200-byte request) made a 224 MB body in 42 s and stalled ``/live`` for 27 s. One choice of
  128k tokens, or 16 choices of 16k, fit. A request that does not set ``max_tokens`` gets
  the remaining context, cut to fit this budget, instead of a refusal.

Integers that reach an engine as numbers (``seed``, ``top_k``, ...) are held to the int64
range when decoded (``protocols.openai``); ``seed + n - 1`` (the last choice's seed) is checked
here, as is every stop token id against the model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from turnout.errors import ConfigError, RequestError

#: The range of a seed, as vLLM and the wire (msgpack int64) take it.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds on one request (see the module docstring for the defaults)."""

    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_messages: int = 10_000
    max_tools: int = 256
    max_tools_chars: int = 1 << 20
    max_choices: int = 16
    max_response_items: int = 1 << 18

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{f.name.replace('_', '-')} must be at least 1, got {value}")

    # ---------------------------------------------------------------- fields

    def check_stop(self, stop: str | Sequence[str] | None, param: str = "stop") -> None:
        """Stop strings: how many, and how long each."""
        if stop is None:
            return
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > self.max_stop_strings:
            raise RequestError(
                f"'{param}' has {len(stops)} strings; at most {self.max_stop_strings} are "
                "allowed (--max-stop-strings)",
                param=param,
            )
        for s in stops:
            if len(s) > self.max_stop_string_chars:
                raise RequestError(
                    f"'{param}' has a string of {len(s)} characters; at most "
                    f"{self.max_stop_string_chars} are allowed (--max-stop-string-chars)",
                    param=param,
                )

    def check_stop_token_ids(
        self, ids: Sequence[int] | None, vocab_size: int, param: str = "stop_token_ids"
    ) -> None:
        """Stop token ids: how many, and each one of the model's."""
        if not ids:
            return
        if len(ids) > self.max_stop_token_ids:
            raise RequestError(
                f"'{param}' has {len(ids)} ids; at most {self.max_stop_token_ids} are allowed "
                "(--max-stop-token-ids)",
                param=param,
            )
        for t in ids:
            if not 0 <= t < vocab_size:
                raise RequestError(
                    f"token id {t} in '{param}' is out of range for this model "
                    f"(0..{vocab_size - 1})",
                    param=param,
                )

    def check_messages(self, count: int, param: str = "messages") -> None:
        if count > self.max_messages:
            raise RequestError(
                f"'{param}' has {count} messages; at most {self.max_messages} are allowed "
                "(--max-messages)",
                param=param,
            )

    def check_tools(self, count: int, chars: int = 0, param: str = "tools") -> None:
        """Tools: how many, and the size of their JSON (``chars``, when known)."""
        if count > self.max_tools:
            raise RequestError(
                f"'{param}' has {count} tools; at most {self.max_tools} are allowed (--max-tools)",
                param=param,
            )
        if chars > self.max_tools_chars:
            raise RequestError(
                f"'{param}' is {chars} characters of JSON; at most {self.max_tools_chars} are "
                "allowed (--max-tools-chars)",
                param=param,
            )

    def check_choices(self, n: int | None) -> None:
        if n is not None and not 1 <= n <= self.max_choices:
            raise RequestError(
                f"'n' must be between 1 and {self.max_choices} (--max-choices), got {n}",
                param="n",
            )

    def check_seed(self, seed: int | None, n: int | None) -> None:
        """The seed of every choice (``seed + i``) within the int64 range engines take."""
        if seed is None:
            return
        last = seed + (n or 1) - 1
        if not SEED_MIN <= seed <= SEED_MAX or last > SEED_MAX:
            extra = f" (choice i gets seed + i, up to {last})" if last != seed else ""
            raise RequestError(
                f"'seed' must be between {SEED_MIN} and {SEED_MAX}{extra}", param="seed"
            )

    # ---------------------------------------------------------------- the response

    def response_items(self, n: int | None, max_tokens: int, alternatives: int) -> int:
        """Entries of the response: tokens, and their alternatives, of every choice."""
        return (n or 1) * max_tokens * (1 + alternatives)

    def check_response(self, n: int | None, max_tokens: int, alternatives: int, param: str) -> None:
        """A response of ``n`` choices of ``max_tokens`` tokens with ``alternatives`` each
        within ``max_response_items``."""
        items = self.response_items(n, max_tokens, alternatives)
        if items > self.max_response_items:
            raise RequestError(
                f"the response may hold {items} tokens and alternatives (n={n or 1} x "
                f"{param}={max_tokens} x (1 + {alternatives} alternatives)); at most "
                f"{self.max_response_items} are allowed (--max-response-items): lower "
                f"'{param}', 'n' or the alternatives asked for",
                param=param,
            )

    def max_tokens_within(self, n: int | None, alternatives: int) -> int:
        """The most tokens a choice may generate within ``max_response_items``: the cap of
        a request that did not set ``max_tokens``."""
        return max(1, self.max_response_items // ((n or 1) * (1 + alternatives)))


__all__ = ["SEED_MAX", "SEED_MIN", "RequestLimits"]
