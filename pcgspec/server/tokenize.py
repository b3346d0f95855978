"""Prompts -> token ids: short ones on the event loop, the rest on worker threads, with long
prompts on a lane of their own.

Hugging Face fast tokenizers release the GIL while they split and merge, so tokenizing a long
prompt on a worker thread keeps the loop answering. A short one is cheaper inline: its work is
mostly the tokenizer's Python (and the chat template's), which holds the GIL on any thread, and
the trip to a worker and back costs two thread hand-offs and a wake-up of the loop, on the path
of every arrival. A prompt that cannot fit is rejected from its length in characters before any
work.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pcgspec.llm import chat_text
from pcgspec.server.protocol import ApiError, GenerationRequest, bad

INLINE_PROMPT_CHARS = 512  # shorter prompts tokenize on the event loop
CHAT_MESSAGE_CHARS = 64  # what a chat template adds around a message, counted towards that
LONG_PROMPT_CHARS = 32_768  # longer prompts tokenize on the "long" lane
LANE_WORKERS = 2


def max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token adds to a text: its vocabulary string is at
    least as long (byte-level BPE: one character per byte; SentencePiece: a "▁" more)."""
    return max(1, *map(len, tokenizer.get_vocab()))


class PromptEncoder:
    """Token ids per prompt of a request; short and long prompts never wait for each other."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        # NOTE: a text of c characters has at least c / max_token_chars tokens; the factor 2
        # leaves room for normalizers that shorten text.
        self.max_chars = 2 * max_model_len * max_token_chars(tokenizer)
        self._short = ThreadPoolExecutor(LANE_WORKERS, thread_name_prefix="pcgspec-tokenize")
        self._long = ThreadPoolExecutor(LANE_WORKERS, thread_name_prefix="pcgspec-tokenize-long")

    async def encode(self, req: GenerationRequest) -> list[list[int]]:
        """400 at once when a prompt is too long to fit by its characters alone. Prompts that
        are token ids already, and texts of ``INLINE_PROMPT_CHARS`` together at most, take no
        trip to a worker thread (and back through the loop)."""
        if not req.chat and not any(isinstance(p, str) for p in req.prompts):
            return list(req.prompts)  # type: ignore[arg-type]
        chars = self._check_chars(req)
        if self._inline_chars(req, chars) <= INLINE_PROMPT_CHARS:
            return self._encode(req)
        pool = self._long if chars > LONG_PROMPT_CHARS else self._short
        return await asyncio.get_running_loop().run_in_executor(pool, self._encode, req)

    @staticmethod
    def _inline_chars(req: GenerationRequest, chars: int) -> int:
        """The characters a request's tokenizing reads, all prompts together; chat: ``chars``
        (``_check_chars``: every message's) with the template's text around each message, so
        that many short messages are not short."""
        if req.chat:
            return chars + CHAT_MESSAGE_CHARS * len(req.messages)
        return sum(len(p) for p in req.prompts if isinstance(p, str))

    def _check_chars(self, req: GenerationRequest) -> int:
        """The longest text to tokenize, in characters (chat: all messages together)."""
        if req.chat:
            longest = sum(len(m["content"]) for m in req.messages)
        else:
            longest = max(len(p) if isinstance(p, str) else 0 for p in req.prompts)
        if longest > self.max_chars:
            raise bad(
                "messages" if req.chat else "prompt",
                f"the prompt has {longest} characters, more than the context can hold "
                f"({self.max_chars} characters at most)",
                code="context_length_exceeded",
            )
        return longest

    def _encode(self, req: GenerationRequest) -> list[list[int]]:
        tok = self.tokenizer
        if not req.chat:
            return [p if isinstance(p, list) else tok.encode(p) for p in req.prompts]
        try:
            text = chat_text(tok, req.messages)
        except Exception as e:  # jinja errors, e.g. a template that forbids a role order
            raise ApiError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from None
        # NOTE: the template already holds the special tokens it wants.
        return [tok.encode(text, add_special_tokens=False)]

    def shutdown(self) -> None:
        for pool in (self._short, self._long):
            pool.shutdown(wait=False, cancel_futures=True)
