"""Typed field getters for JSON request bodies; a bad value raises a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any

MAX_STOP = 64


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_int_list(value: object) -> bool:
    """Whether ``value`` is a non-empty list of ints, bools excluded. Checked at C speed: a
    prompt of token ids may hold 100,000 of them, and a check per id in Python cost the server
    ~2 ms per 2,000-token request, which requests arriving together wait for in turn."""
    return isinstance(value, list) and set(map(type, value)) == {int}


def in_vocab(ids: list[int], vocab: int) -> bool:
    """Whether the (non-empty) ``ids`` are in [0, vocab)."""
    return min(ids) >= 0 and max(ids) < vocab


def utf8(value: str, param: str) -> str:
    """``value`` if it is encodable text (JSON may carry lone surrogates, which are not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(param, f"{param} is not valid UTF-8 text (a lone surrogate?)") from None
    return value


def get_int(body: dict[str, Any], name: str, lo: int, hi: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or not lo <= value <= hi:
        raise bad(name, f"{name} must be an integer in [{lo}, {hi}], got {show(value)}")
    return value


def get_float(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    # NOTE: ints compare exactly (a 400-digit int has no float); floats must be finite.
    if not number or not (isinstance(value, int) or math.isfinite(value)) or not lo <= value <= hi:
        raise bad(name, f"{name} must be a number in [{lo}, {hi}], got {show(value)}")
    return float(value)


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be a boolean, got {show(value)}")
    return value


def get_stop(body: dict[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP
        or any(not isinstance(s, str) or not s for s in stops)
    ):
        raise bad(
            "stop",
            f"stop must be a non-empty string or a list of at most {MAX_STOP} "
            f"non-empty strings, got {show(stop)}",
        )
    return [utf8(s, "stop") for s in stops]


def get_token_ids(body: dict[str, Any], name: str, vocab: int) -> list[int] | None:
    ids = body.get(name)
    if ids is None:
        return None
    if not isinstance(ids, list) or (ids and not (is_int_list(ids) and in_vocab(ids, vocab))):
        raise bad(name, f"{name} must be a list of token ids in [0, {vocab}), got {show(ids)}")
    return ids
