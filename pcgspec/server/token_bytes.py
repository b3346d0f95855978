"""Each token's real bytes, and the logprobs ``token`` strings built from them.

A byte-level BPE token (GPT-2, SmolLM2, Llama 3) may hold part of a UTF-8 character: decoding it
alone gives U+FFFD, so alternatives collapse and the bytes no longer join back into the text.
The bytes come from the token's vocabulary string through the GPT-2 byte <-> unicode table.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes map to themselves, the others to chr(256 + k)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + k) for k, b in enumerate(extra)})
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder")
    return '"ByteLevel"' in json.dumps(decoder)


class TokenBytes:
    """``token_bytes(token_id) -> bytes``, cached; thread-safe enough (a dict of immutables)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._cache: dict[int, bytes] = {i: t.content.encode() for i, t in added.items()}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self._tokenizer.decode([token_id]).encode()


def token_string(raw: bytes) -> str:
    """The text of a token; a token that is not whole UTF-8 reads ``bytes:\\xe4\\xbd`` (OpenAI's
    form), so distinct partial tokens never share a string."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Characters of text completed before each token (completions' ``text_offset``)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def advance(self, raw: bytes) -> int:
        """The offset of the token with bytes ``raw``; then moves past it."""
        offset = self.chars
        self.chars += len(self._decoder.decode(raw))
        return offset
