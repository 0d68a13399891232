"""Router modes: how an instance is picked for a request.

Every mode is named here so flags and error messages are stable; a mode that is not built yet
fails at start-up with a clear ``NotYetSupported``, never silently falls back.
"""

from __future__ import annotations

import enum

from turnout.errors import ConfigError


class RouterMode(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    POWER_OF_TWO = "power-of-two"
    LEAST_LOADED = "least-loaded"
    DEVICE_AWARE_WEIGHTED = "device-aware-weighted"
    DIRECT = "direct"
    KV = "kv"

    @classmethod
    def parse(cls, text: str) -> RouterMode:
        try:
            return cls(text.strip().lower().replace("_", "-"))
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown router mode {text!r}; choose one of: {names}") from None


#: LoRA-aware routing exists only for these (as Dynamo's ``validate_router_mode_for_lora``).
LORA_ROUTER_MODES = frozenset({RouterMode.KV, RouterMode.RANDOM, RouterMode.ROUND_ROBIN})


def validate_router_mode_for_lora(
    mode: RouterMode, *, lora_enabled: bool, session_affinity_enabled: bool = False
) -> None:
    """Reject LoRA with a mode that cannot keep adapter traffic on adapter holders.

    Checked at start-up, before any wait for workers, so a misconfiguration fails fast.
    """
    if not lora_enabled:
        return
    if session_affinity_enabled and mode in (RouterMode.RANDOM, RouterMode.ROUND_ROBIN):
        raise ConfigError(
            f"session affinity is unsupported with LoRA serving and {mode.value} routing"
        )
    if mode not in LORA_ROUTER_MODES:
        raise ConfigError(
            f"LoRA serving is not supported with router mode {mode.value}; use kv, random "
            "or round-robin for LoRA-aware routing, or disable LoRA serving."
        )
