"""Incremental detokenization: each new token yields the text it completes, if any.

Fast tokenizers (a ``tokenizers.Tokenizer`` backend, every tokenizer the loader builds) decode
through the library's ``DecodeStream``, as vLLM's fast detokenizer does: under a microsecond a
token, where ``tokenizer.decode`` of a window costs 5-20 us through transformers' argument
handling (at batch 64 that was most of the engine's postprocessing). Tokenizers without such a
backend decode a bounded window of ids twice per token instead.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as left context so the first output token decodes with correct spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """``add_token`` returns the text a token completes; ``text`` is everything so far.

    Text is emitted once it no longer ends in a partial UTF-8 character.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._decoder: _StreamDecoder | _WindowDecoder = (
            _StreamDecoder(backend, context, skip_special_tokens)
            if backend is not None
            else _WindowDecoder(tokenizer, context, skip_special_tokens)
        )
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append ``token_id``; return the newly completed text (possibly empty)."""
        delta = self._decoder.add(token_id)
        self.text += delta
        return delta


class _StreamDecoder:
    def __init__(self, backend: object, context: list[int], skip_special_tokens: bool) -> None:
        self.backend, self.skip_special_tokens = backend, skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context:  # their text is the prompt's: dropped
            self.add(token_id)

    def add(self, token_id: int) -> str:
        try:
            return self.stream.step(self.backend, token_id) or ""
        except Exception as e:  # NOTE: the stream's prefix no longer decodes the same (rare)
            if "Invalid prefix" not in str(e):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.backend, token_id) or ""


class _WindowDecoder:
    """Decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]`` per token."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = context
        self.prefix_offset, self.read_offset = 0, len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]
