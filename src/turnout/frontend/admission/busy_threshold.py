"""``/busy_threshold``: read and change each model's busy thresholds at run time, in the
shape of Dynamo's endpoint of the same name.

``GET /busy_threshold`` lists every served model::

    {"thresholds": [{"model": "m", "kv_usage": 0.9, "num_waiting": null, ...}]}

``POST /busy_threshold`` with ``{"model": "m"}`` reads one model; with ``"kv_usage"``
(a fraction in [0, 1]; Dynamo's ``active_decode_blocks_threshold`` is the same quantity and
accepted under that name) and/or ``"num_waiting"`` (an integer >= 0) it sets them and
answers the new values. ``null`` or an omitted field leaves a threshold as it is (as in
Dynamo). A worker whose latest load report is over a threshold is left out of the KV
router's candidates from the next decision on (its report is judged again at once).

What applies where: only the KV router reads workers' load reports, so thresholds exist for
models routed in ``kv`` mode (Tokens-input models; text-input ones are spread round-robin).
For any other model each entry says ``"applies": false`` and setting a threshold is a 400,
never accepted and ignored. Dynamo's ``active_prefill_tokens_threshold`` has no counterpart
here (turnout's second threshold counts waiting requests): it is always ``null`` in answers
and a 400 when set. A value changed here lasts as long as the model's router: when the model
leaves discovery and comes back, its router starts again from the command-line flags.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec

from turnout.frontend.http.errors import HttpError, request_decode_error
from turnout.router.kv.router import KvRouter
from turnout.router.kv.worker_load import WorkerLoads
from turnout.router.mode import RouterMode

#: Dynamo's name for the KV usage threshold, and its prefill-token threshold (unsupported).
DYNAMO_KV_FIELD = "active_decode_blocks_threshold"
DYNAMO_PREFILL_FIELD = "active_prefill_tokens_threshold"

_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")


class BusyThresholdRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /busy_threshold``."""

    model: Annotated[str, msgspec.Meta(max_length=1024)]
    kv_usage: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    num_waiting: Annotated[int, msgspec.Meta(ge=0)] | None = None
    active_decode_blocks_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    active_prefill_tokens_threshold: float | None = None


_decoder = msgspec.json.Decoder(BusyThresholdRequest)


class BusyThresholds:
    """The logic behind the two routes; the HTTP layer only moves bytes.

    ``list_models``: the served names (``ModelManager.list_models``); ``kv_routers``: the
    live KV router of each model routed in ``kv`` mode (``PipelineFactory.kv_routers``).
    """

    def __init__(
        self,
        list_models: Callable[[], list[str]],
        kv_routers: Mapping[str, KvRouter],
        router_mode: RouterMode,
    ) -> None:
        self._list_models = list_models
        self._kv_routers = kv_routers
        self._router_mode = router_mode

    def get_all(self) -> dict[str, Any]:
        return {"thresholds": [self._entry(name) for name in self._list_models()]}

    def post(self, body: bytes) -> dict[str, Any]:
        """Read or change one model's thresholds; ``HttpError`` 400/404 for a bad body or
        an unknown model."""
        try:
            request = _decoder.decode(body)
        except msgspec.ValidationError as exc:
            unknown = _UNKNOWN_FIELD.search(str(exc))
            if unknown is not None:
                raise HttpError(
                    400,
                    f"invalid request: unknown field {unknown.group(1)!r}; known fields: "
                    f"model, kv_usage, num_waiting, {DYNAMO_KV_FIELD}",
                    param=unknown.group(1),
                ) from None
            raise request_decode_error(exc) from None
        except msgspec.DecodeError as exc:
            raise request_decode_error(exc) from None
        name = request.model
        if name not in self._list_models():
            raise HttpError(
                404, f"model {name!r} is not served", param="model", code="model_not_found"
            )
        if request.active_prefill_tokens_threshold is not None:
            raise HttpError(
                400,
                f"{DYNAMO_PREFILL_FIELD} is not supported: turnout's busy thresholds are the "
                "KV usage (kv_usage) and the number of waiting requests (num_waiting)",
                code="unsupported_parameter",
                param=DYNAMO_PREFILL_FIELD,
            )
        kv_usage = request.kv_usage
        dynamo_kv = request.active_decode_blocks_threshold
        if kv_usage is not None and dynamo_kv is not None and kv_usage != dynamo_kv:
            raise HttpError(
                400,
                f"kv_usage ({kv_usage}) and {DYNAMO_KV_FIELD} ({dynamo_kv}) name the same "
                "threshold and disagree",
                param=DYNAMO_KV_FIELD,
            )
        if kv_usage is None:
            kv_usage = dynamo_kv
        num_waiting = request.num_waiting
        if kv_usage is not None or num_waiting is not None:
            loads = self._loads(name)
            if loads is None:
                field = (
                    "num_waiting"
                    if kv_usage is None
                    else ("kv_usage" if request.kv_usage is not None else DYNAMO_KV_FIELD)
                )
                raise HttpError(
                    400,
                    f"model {name!r} is routed {self._mode_of(name)}: busy thresholds apply to "
                    "kv routing only (--router-mode kv, Tokens-input models), so this one "
                    "would be ignored",
                    code="unsupported_parameter",
                    param=field,
                )
            loads.set_thresholds(kv_usage=kv_usage, num_waiting=num_waiting)
        return self._entry(name)

    def _loads(self, name: str) -> WorkerLoads | None:
        router = self._kv_routers.get(name)
        return None if router is None else router.core.loads

    def _mode_of(self, name: str) -> str:
        return (
            RouterMode.KV.value
            if name in self._kv_routers
            else (
                RouterMode.ROUND_ROBIN.value
                if self._router_mode is RouterMode.KV
                else self._router_mode.value
            )
        )

    def _entry(self, name: str) -> dict[str, Any]:
        loads = self._loads(name)
        kv = None if loads is None else loads.busy_kv_usage_threshold
        return {
            "model": name,
            "kv_usage": kv,
            "num_waiting": None if loads is None else loads.busy_num_waiting_threshold,
            DYNAMO_KV_FIELD: kv,
            DYNAMO_PREFILL_FIELD: None,
            "router_mode": self._mode_of(name),
            "applies": loads is not None,
        }
