"""Incremental detokenization: each new token yields the text it completes, if any."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as left context so the first output token decodes with correct spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes a bounded window ``ids[prefix_offset:]`` per token, never the whole output.

    Text is emitted once it no longer ends in a partial UTF-8 character (U+FFFD).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append ``token_id``; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
