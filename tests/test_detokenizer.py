"""Incremental detokenization equals decoding the whole output, token by token, for both the
fast (``DecodeStream``) and the window decoder: spacing after the prompt, characters split
across tokens, special tokens kept or skipped.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pcgspec.engine import detokenizer
from pcgspec.engine.detokenizer import IncrementalDetokenizer

TEXT = (
    "Sure! Here is 🎉 a naïve café — 東京 <|im_end|> def f(x):\n    return x ** 2\n"
    "<|im_start|>assistant\n  spaced   out\tand ✔︎ done."
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("fast", [True, False], ids=["stream", "window"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_whole_decode(tokenizer, monkeypatch, fast, skip_special_tokens):
    if not fast:  # a tokenizer without a tokenizers backend
        monkeypatch.setattr(type(tokenizer), "backend_tokenizer", None, raising=False)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    out = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in out
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    assert isinstance(
        detok._decoder, detokenizer._StreamDecoder if fast else detokenizer._WindowDecoder
    )
    deltas = [detok.add_token(t) for t in out]
    whole = tokenizer.decode(prompt + out, skip_special_tokens=skip_special_tokens)
    head = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert detok.text == "".join(deltas) == whole[len(head) :]
    assert not any("\ufffd" in d for d in deltas)  # no half of a split character
    assert "" in deltas  # the emoji's and CJK characters' first bytes emitted nothing
