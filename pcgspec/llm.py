"""The offline entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from pcgspec.config import EngineConfig
from pcgspec.engine.engine import Engine
from pcgspec.engine.request import Request
from pcgspec.outputs import RequestOutput
from pcgspec.progress import progress
from pcgspec.runners.tp_worker import serve_if_torchrun_worker
from pcgspec.sampling_params import SamplingParams

# vLLM's prompt forms: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | Mapping[str, Any]
Message = dict[str, str]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
logger = logging.getLogger("pcgspec")


def chat_text(tokenizer: Any, messages: Sequence[Message]) -> str:
    """A conversation through the tokenizer's chat template, ready for the assistant's turn
    (the template's errors propagate: the server answers them with a 400)."""
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


def chat_prompt(tokenizer: Any, messages: Sequence[Message]) -> tuple[str, list[int]]:
    """The text and token ids of a conversation through the tokenizer's chat template, ready
    for the assistant's turn.
    """
    text = chat_text(tokenizer, messages)
    # NOTE: the template already holds the special tokens it wants.
    return text, tokenizer.encode(text, add_special_tokens=False)


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``generate``/``chat``: ``outputs`` holds what was generated so far (the
    unfinished sequences are aborted, finish reason "abort").
    """

    def __init__(self, outputs: list[RequestOutput]) -> None:
        super().__init__("generation interrupted")
        self.outputs = outputs


class LLM:
    """An engine with a blocking ``generate``. ``model=None`` loads the embedded default
    model (SmolLM2-135M-Instruct), fetching and converting it on first use. Every other keyword
    is an ``EngineConfig`` field; an unknown one raises ``ValueError``.

    On the CPU the engine sets torch's intra-op thread count when it starts (``cpu_threads``,
    else ``OMP_NUM_THREADS``, else the idle physical cores: ``engine/cpu_threads.py``); that is
    process-wide, and importing pcgspec changes nothing.
    It leaves the garbage collector of the caller's process as it found it (no ``gc.freeze``);
    a program that owns its process may freeze what start-up built once its engines are up
    (``pcgspec.engine.collector.freeze_start_up``, as the server does).

    Under ``torchrun`` with ``tp_size`` > 1 every process of the job runs the same script: rank
    0 gets the engine, and on every other rank the constructor serves rank 0's steps until rank
    0 shuts down, then ends the process (``SystemExit(0)``).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        if config.log_level:
            logging.getLogger("pcgspec").setLevel(config.log_level.upper())
        if serve_if_torchrun_worker(config):
            raise SystemExit(0)
        self.config = config
        start = time.perf_counter()
        self.engine = Engine(config)
        # NOTE: tensor-parallel workers are stopped and the groups torn down when the LLM is
        # collected or at interpreter exit, while CUDA is up: an NCCL group left with live
        # graphs that captured its collectives waits for its peers forever at teardown
        self._shutdown = weakref.finalize(self, self.engine.runner.shutdown)
        logger.info(
            "Engine ready in %.1f s (piecewise path %s)",
            time.perf_counter() - start,
            "on" if self.engine.runner.piecewise is not None else "off",
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done when the LLM is
        collected, and at exit)."""
        self._shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them, each text, token ids, ``{"prompt": text}``
        or ``{"prompt_token_ids": ids}`` (vLLM's forms); outputs come back in prompt order.
        """
        encode = self.engine.tokenizer.encode
        pairs = [
            (text, encode(text) if ids is None else ids)
            for text, ids in map(_parse_prompt, _as_prompt_list(prompts))
        ]
        return self._generate(pairs, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        pairs = [chat_prompt(self.engine.tokenizer, c) for c in conversations]
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
        try:
            self._run(sum(len(reqs) for _, reqs in groups), use_tqdm)
        except KeyboardInterrupt:
            for _, reqs in groups:
                self.engine.abort(reqs[0].group_id)
            raise GenerationInterrupted(self._outputs(groups)) from None
        return self._outputs(groups)

    def _outputs(self, groups: list[tuple[str | None, list[Request]]]) -> list[RequestOutput]:
        decode = self._decode_token
        return [RequestOutput.from_requests(text, reqs, decode) for text, reqs in groups]

    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _run(self, num_sequences: int, use_tqdm: bool) -> None:
        with progress(total=num_sequences, desc="generate", unit="seq", show=use_tqdm) as bar:
            while self.engine.has_unfinished:
                done = sum(r.finished for r in self.engine.step())
                bar.update(done)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {_what(prompts)}")
    if prompts and _is_token_id(prompts[0]):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _parse_prompt(prompt: object) -> tuple[str | None, list[int] | None]:
    """``(text, token_ids)`` of one prompt, one of them None; anything else raises."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if len(keys) != 1 or not keys <= set(_PROMPT_KEYS):
            raise ValueError(
                f"a prompt dict needs exactly one of the keys {_PROMPT_KEYS}, "
                f"got keys {sorted(map(str, keys))}"
            )
        if "prompt" in prompt:
            return _parse_text(prompt["prompt"]), None
        return None, _parse_token_ids(prompt["prompt_token_ids"])
    if isinstance(prompt, Sequence):
        return None, _parse_token_ids(prompt)
    raise TypeError(
        "a prompt must be a str, a list of token ids, {'prompt': str} or "
        f"{{'prompt_token_ids': [int, ...]}}, got {_what(prompt)}"
    )


def _parse_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"'prompt' must be a str, got {_what(text)}")
    return text


def _parse_token_ids(ids: object) -> list[int]:
    if isinstance(ids, str) or not isinstance(ids, Sequence) or not all(map(_is_token_id, ids)):
        raise TypeError(f"token ids must be a list of ints, got {_what(ids)}")
    return list(ids)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _what(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


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
