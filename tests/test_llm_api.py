"""``LLM.generate``'s prompt forms (vLLM's): text, token ids, ``{"prompt": ...}``,
``{"prompt_token_ids": ...}`` and lists of them; anything else is rejected by name.
"""

from __future__ import annotations

import pytest

from pcgspec import LLM, SamplingParams
from pcgspec.llm import _as_prompt_list, _parse_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(str(smollm2_path), dtype="float32", device="cpu", disable_piecewise_cuda_graph=True)


def test_a_hub_id_is_refused_naming_what_to_pass(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"model 'Qwen/Qwen2.5-0.5B' .*hub are not available"
        r".*config\.json.*\.gguf file, or no model",
    ):
        LLM("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ValueError, match="tokenizer 'org/tok' .*hub"):
        LLM(tokenizer="org/tok")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)  # a local folder of that name is a path
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM("org/name")


def test_every_prompt_form_generates_the_same_tokens(llm):
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    want = llm.generate(text, GREEDY, use_tqdm=False)[0].token_ids
    forms = [
        {"prompt": text},
        {"prompt_token_ids": ids},
        ids,
        [{"prompt": text}],
        [{"prompt_token_ids": ids}, text, ids],
    ]
    for form in forms:
        outs = llm.generate(form, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [want] * len(outs), form
    out = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].prompt is None


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ({"text": "hi"}, ValueError, r"exactly one of the keys .*got keys \['text'\]"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, ValueError, "exactly one of the keys"),
        ({"prompt": 5}, TypeError, "'prompt' must be a str, got int 5"),
        ({"prompt_token_ids": "hi"}, TypeError, "token ids must be a list of ints, got str"),
        ({"prompt_token_ids": [1, 2.5]}, TypeError, "token ids must be a list of ints"),
        ([1, "a"], TypeError, "token ids must be a list of ints"),
        ([True, 2], TypeError, "a prompt must be a str"),
        (3.5, TypeError, "prompts must be a prompt or a list of prompts, got float 3.5"),
        ([None], TypeError, "a prompt must be a str.*got NoneType None"),
    ],
)
def test_other_prompts_are_rejected_naming_what_was_given(prompt, error, match):
    with pytest.raises(error, match=match):
        [_parse_prompt(p) for p in _as_prompt_list(prompt)]


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(TypeError):
        llm.generate(["fine", {"prompt": 1}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished
