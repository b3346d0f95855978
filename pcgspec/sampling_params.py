"""Per-request sampling parameters, with vLLM's field names and validation."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field, fields

_GREEDY_EPS = 1e-5
_F32_MIN_NORMAL = 2.0**-126


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` means greedy.

    Invalid values raise ``ValueError`` naming the field and the value; unknown keyword
    arguments are rejected by ``SamplingParams.from_kwargs`` (and by the constructor's
    ``TypeError``, which ``from_kwargs`` turns into a ``ValueError``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    _stop: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stop = self.stop
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        object.__setattr__(self, "_stop", stop)
        self._validate()

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> SamplingParams:
        known = {f.name for f in fields(cls) if f.init}
        for name, value in kwargs.items():
            if name not in known:
                raise ValueError(
                    f"unknown sampling parameter {name}={value!r}; "
                    f"known: {', '.join(sorted(known))}"
                )
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        # NOTE: the sampler reads float32: a value must keep its meaning after the cast.
        if not 0.0 <= _f32(self.temperature) < math.inf:
            raise bad("temperature", "must be a number >= 0 that is finite in float32")
        if not (0.0 < _f32(self.top_p) and self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1] and not round to 0 in float32")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if not _F32_MIN_NORMAL <= _f32(self.repetition_penalty) < math.inf:
            raise bad(
                "repetition_penalty",
                f"must be > 0, finite and normal in float32 (>= {_F32_MIN_NORMAL:.4g})",
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        if self.stop_token_ids is not None and any(
            not isinstance(t, int) or t < 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _f32(value: float) -> float:
    """``value`` rounded to float32 (inf beyond its range); NaN stays NaN."""
    try:
        return array("f", [value])[0]
    except OverflowError:  # an int too large for a double
        return math.inf if value > 0 else -math.inf
