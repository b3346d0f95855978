"""The offline entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pcgspec.config import EngineConfig
from pcgspec.engine.engine import Engine
from pcgspec.outputs import RequestOutput
from pcgspec.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """An engine with a blocking ``generate``. ``model=None`` loads the embedded default
    model (SmolLM2-135M-Instruct), fetching and converting it on first use. Every other keyword
    is an ``EngineConfig`` field; an unknown one raises ``ValueError``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        if config.log_level:
            logging.getLogger("pcgspec").setLevel(config.log_level.upper())
        self.config = config
        self.engine = Engine(config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        encode = self.engine.tokenizer.encode
        pairs = [(p, encode(p)) if isinstance(p, str) else (None, list(p)) for p in prompts]
        return self._generate(pairs, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        texts = [
            tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False)
            for c in conversations
        ]
        # NOTE: the template already holds the special tokens it wants.
        pairs = [(t, tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        return self._generate(pairs, sampling_params, use_tqdm)

    def _generate(
        self,
        prompts: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params = _as_params_list(sampling_params, len(prompts))
        groups = [
            (text, self.engine.add_request(ids, p)) for (text, ids), p in zip(prompts, params)
        ]
        self._run(sum(len(reqs) for _, reqs in groups), use_tqdm)
        return [RequestOutput.from_requests(text, reqs) for text, reqs in groups]

    def _run(self, num_sequences: int, use_tqdm: bool) -> None:
        with tqdm(total=num_sequences, desc="generate", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished:
                done = sum(r.finished for r in self.engine.step())
                bar.update(done)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params
