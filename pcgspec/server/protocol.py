"""OpenAI request bodies -> validated generation requests; errors as OpenAI error bodies.

Every check names the offending field (``param``) so a client sees what to fix; the bounds
also keep every value representable in the engine's tensors (a bad value is a 400 here,
never an exception inside a step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pcgspec.sampling_params import SamplingParams
from pcgspec.server.validate import (
    ApiError,
    bad,
    get_bool,
    get_float,
    get_int,
    get_stop,
    get_token_ids,
    in_vocab,
    is_int,
    is_int_list,
    show,
    utf8,
)

__all__ = [
    "ApiError",
    "GenerationRequest",
    "Limits",
    "check_prompt_length",
    "parse_chat",
    "parse_completion",
]

MAX_N = 128
MAX_PROMPTS = 256  # prompts x n of one completions request
MAX_LOGPROBS = 20
_INT64 = 1 << 63
_ROLES = ("system", "developer", "user", "assistant", "tool")
# field -> the only values accepted (the OpenAI defaults); anything else is "not supported".
_UNSUPPORTED = {
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}

_SAMPLING = (
    *"n best_of temperature top_p top_k min_p seed repetition_penalty presence_penalty".split(),
    *"frequency_penalty stop stop_token_ids ignore_eos skip_special_tokens".split(),
    *"include_stop_str_in_output stream stream_options model user".split(),
    *_UNSUPPORTED,
)
_FIELDS = {
    False: frozenset((*_SAMPLING, "prompt", "max_tokens", "logprobs")),
    True: frozenset(
        (*_SAMPLING, "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs")
    ),
}
_MAX_WARNED = 256  # field names remembered; a client sending endless new ones is not logged
logger = logging.getLogger("pcgspec")
_warned: set[str] = set()


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the served model and its sizes."""

    model_name: str
    vocab_size: int
    max_model_len: int  # prompt + output tokens: the context length or the KV pool, the lesser


@dataclass(frozen=True)
class GenerationRequest:
    """A parsed ``/v1/completions`` (``prompts``) or ``/v1/chat/completions`` (``messages``)."""

    chat: bool
    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompts: tuple[str | list[int], ...] = ()
    messages: tuple[dict[str, str], ...] = ()


def _check_common(body: dict[str, Any], limits: Limits) -> str:
    """The model name (404 when unknown) and the fields no endpoint supports."""
    for name, allowed in _UNSUPPORTED.items():
        if name in body and not any(
            body[name] == a and type(body[name]) is type(a) for a in allowed
        ):
            raise bad(name, f"{name}={show(body[name])} is not supported", code="unsupported")
    model = body.get("model")
    if model is None:
        return limits.model_name
    if not isinstance(model, str):
        raise bad("model", f"model must be a string, got {show(model)}")
    if model != limits.model_name:
        raise ApiError(
            404,
            f"The model {show(model)} does not exist; this server serves {limits.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return model


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or not stream:
        raise bad("stream_options", "stream_options must be an object, and only with stream=true")
    return stream, get_bool(options, "include_usage", False)


def sampling_params(
    body: dict[str, Any], limits: Limits, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The sampling fields shared by both endpoints (vLLM's extra fields included)."""
    vocab = limits.vocab_size
    kwargs = dict(
        n=get_int(body, "n", 1, MAX_N, 1),
        temperature=get_float(body, "temperature", 0.0, 100.0, 1.0),
        top_p=get_float(body, "top_p", 0.0, 1.0, 1.0),
        top_k=get_int(body, "top_k", -1, vocab, -1),
        min_p=get_float(body, "min_p", 0.0, 1.0, 0.0),
        seed=get_int(body, "seed", -_INT64, _INT64 - 1, None),
        repetition_penalty=get_float(body, "repetition_penalty", 0.0, 100.0, 1.0),
        presence_penalty=get_float(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=get_float(body, "frequency_penalty", -2.0, 2.0, 0.0),
        max_tokens=max_tokens,
        stop=get_stop(body),
        stop_token_ids=get_token_ids(body, "stop_token_ids", vocab),
        ignore_eos=get_bool(body, "ignore_eos", False),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
        logprobs=logprobs,
    )
    _check_best_of(body, kwargs["n"])
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # SamplingParams names the field first
        field = str(e).split(" ", 1)[0]
        raise bad(field if field in kwargs else None, str(e)) from None


def _check_best_of(body: dict[str, Any], n: int) -> None:
    """``best_of`` is accepted only as a no-op: unset, or equal to ``n``."""
    value = body.get("best_of")
    if value is not None and not (is_int(value) and value == n):
        raise bad("best_of", f"best_of must equal n ({n}) when given, got {show(value)}")


def warn_unknown_fields(body: dict[str, Any], chat: bool) -> None:
    """A WARNING, once per field name, for fields this server ignores (refused by none)."""
    for name in body.keys() - _FIELDS[chat]:
        if name not in _warned and len(_warned) < _MAX_WARNED:
            _warned.add(name)
            logger.warning("request field %s is not supported and was ignored", show(name))


def _max_tokens(
    body: dict[str, Any], names: tuple[str, ...], limits: Limits, default: int | None
) -> int | None:
    """The first of ``names`` that is set; bounded by the model length."""
    for name in names:
        if body.get(name) is not None:
            return get_int(body, name, 1, limits.max_model_len, None)
    return default


def _prompts(body: dict[str, Any], vocab: int) -> tuple[str | list[int], ...]:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    prompt = body.get("prompt")
    # NOTE: one prompt of token ids is type-checked once: requests arriving together wait in
    # turn for each other's checks.
    items = [prompt] if isinstance(prompt, str) or is_int_list(prompt) else prompt
    if not isinstance(items, list) or not items or len(items) > MAX_PROMPTS:
        raise bad(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or "
            f"a list of such lists (1 to {MAX_PROMPTS}), got {show(prompt)}",
        )
    for item in items:
        if isinstance(item, str):
            utf8(item, "prompt")
            continue
        if not ((item is prompt or is_int_list(item)) and in_vocab(item, vocab)):
            raise bad("prompt", f"token-id prompts must hold ids in [0, {vocab}), got {show(item)}")
    return tuple(items)


def parse_completion(body: dict[str, Any], limits: Limits) -> GenerationRequest:
    model = _check_common(body, limits)
    warn_unknown_fields(body, chat=False)
    prompts = _prompts(body, limits.vocab_size)
    logprobs = get_int(body, "logprobs", 0, MAX_LOGPROBS, None)
    max_tokens = _max_tokens(body, ("max_tokens",), limits, 16)
    params = sampling_params(body, limits, max_tokens, logprobs)
    if len(prompts) * params.n > MAX_PROMPTS:
        raise bad("n", f"{len(prompts)} prompts x n={params.n} exceeds {MAX_PROMPTS} sequences")
    stream, include_usage = _stream_flags(body)
    return GenerationRequest(False, model, params, stream, include_usage, prompts=prompts)


def _message(i: int, msg: object) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad(where, f"{where} must be an object, got {show(msg)}")
    role, content = msg.get("role"), msg.get("content")
    if role not in _ROLES:
        raise bad(
            f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}, got {show(role)}"
        )
    if isinstance(content, list):
        parts = content
        if any(
            not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
            for p in parts
        ):
            raise bad(
                f"{where}.content",
                f'{where}.content parts must be {{"type": "text", "text": str}} (text only)',
            )
        content = "".join(p["text"] for p in parts)
    if not isinstance(content, str):
        raise bad(
            f"{where}.content",
            f"{where}.content must be a string or a list of text parts, got {show(content)}",
        )
    return {"role": role, "content": utf8(content, f"{where}.content")}


def parse_chat(body: dict[str, Any], limits: Limits) -> GenerationRequest:
    model = _check_common(body, limits)
    warn_unknown_fields(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages must be a non-empty list, got {show(messages)}")
    parsed = tuple(_message(i, m) for i, m in enumerate(messages))
    top = get_int(body, "top_logprobs", 0, MAX_LOGPROBS, None)
    wants = get_bool(body, "logprobs", False)
    if top is not None and not wants:
        raise bad("top_logprobs", "top_logprobs needs logprobs=true")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits, None)
    params = sampling_params(body, limits, max_tokens, (top or 0) if wants else None)
    stream, include_usage = _stream_flags(body)
    return GenerationRequest(True, model, params, stream, include_usage, messages=parsed)


def check_prompt_length(num_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """400 unless the prompt, and the prompt plus ``max_tokens``, fit in ``max_model_len``."""
    if num_tokens == 0:
        raise bad("prompt", "the prompt is empty (0 tokens)")
    total = num_tokens + (max_tokens or 1)
    if num_tokens >= max_model_len or total > max_model_len:
        asked = f" and max_tokens={max_tokens} ({total} in total)" if max_tokens else ""
        raise bad(
            "prompt" if num_tokens >= max_model_len else "max_tokens",
            f"This model's maximum context length is {max_model_len} tokens; the prompt "
            f"has {num_tokens} tokens{asked}",
            code="context_length_exceeded",
        )
