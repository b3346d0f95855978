"""OpenAI response bodies and stream chunks, built from the engine's per-sequence deltas."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcgspec.engine.request import TokenLogprobs

DONE = b"data: [DONE]\n\n"
TokenText = Callable[[int], str]


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Choice:
    """One output sequence of a non-streaming response, accumulated from its deltas."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


def completion_logprobs(
    lps: Sequence[TokenLogprobs], token_text: TokenText, offset: int = 0
) -> dict[str, list[Any]]:
    """The completions ``logprobs`` object; ``offset``: text length before these tokens."""
    tokens = [token_text(lp.token_id) for lp in lps]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: Sequence[TokenLogprobs], token_text: TokenText) -> dict[str, list[Any]]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]
    return {"content": content}


@dataclass(frozen=True)
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool

    def chunk(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, int] | None = None,
        with_usage_field: bool = False,
    ) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or with_usage_field:
            out["usage"] = usage
        return out

    def body(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


def chunk_choice(
    chat: bool,
    index: int,
    text: str | None,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    role: bool = False,
) -> dict[str, Any]:
    if not chat:
        return {
            "index": index,
            "text": text or "",
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def body_choice(
    chat: bool, index: int, choice: Choice, want_logprobs: bool, token_text: TokenText
) -> dict[str, Any]:
    if chat:
        lps = chat_logprobs(choice.logprobs, token_text) if want_logprobs else None
        message = {"role": "assistant", "content": choice.text}
        return {
            "index": index,
            "message": message,
            "logprobs": lps,
            "finish_reason": choice.finish_reason,
        }
    lps = completion_logprobs(choice.logprobs, token_text) if want_logprobs else None
    return {
        "index": index,
        "text": choice.text,
        "logprobs": lps,
        "finish_reason": choice.finish_reason,
    }
