"""Speculative decoding configuration, with SGLang's option names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SUPPORTED_ALGORITHMS = ("EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
POLICIES = ("auto", "always")
_NEEDS_DRAFT_MODEL = ("STANDALONE",)  # EAGLE3 of the default model: its shipped head


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft and verify. k = ``speculative_num_steps`` drafts per request and step; the
    target then scores ``speculative_num_draft_tokens`` = k+1 tokens per request (chain drafting).
    """

    speculative_algorithm: str  # EAGLE3, NEXTN, STANDALONE or NGRAM (any case)
    speculative_draft_model_path: str | None = None  # NEXTN: None = the target's own MTP layers
    speculative_num_steps: int = 3
    speculative_num_draft_tokens: int | None = None  # None = num_steps + 1
    speculative_eagle_topk: int = 1
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # auto: speculate where the measured costs and accept lengths say it pays; always: every step
    speculative_policy: str = "auto"

    def __post_init__(self) -> None:
        algorithm = self.speculative_algorithm
        if not isinstance(algorithm, str) or algorithm.upper() not in SUPPORTED_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of "
                f"{', '.join(SUPPORTED_ALGORITHMS)}, got {algorithm!r}"
            )
        object.__setattr__(self, "speculative_algorithm", algorithm.upper())
        if self.speculative_num_draft_tokens is None and _is_int(self.speculative_num_steps):
            object.__setattr__(self, "speculative_num_draft_tokens", self.num_steps + 1)
        self._validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        for name, value in kwargs.items():
            if name not in known:
                raise ValueError(
                    f"unknown speculative option {name}={value!r}; "
                    f"known: {', '.join(sorted(known))}"
                )
        return cls(**kwargs)

    @property
    def algorithm(self) -> str:
        return self.speculative_algorithm

    @property
    def num_steps(self) -> int:
        """k: draft tokens proposed per request and step."""
        return self.speculative_num_steps

    def draft_model_path(self, target_model: str | None) -> str | None:
        """The draft checkpoint; without one, NEXTN uses the target's (its MTP layers) and
        EAGLE3 the head shipped for the default model (``ValueError`` for another target).
        """
        if self.speculative_draft_model_path is not None:
            return self.speculative_draft_model_path
        if self.algorithm == "NEXTN":
            return target_model
        if self.algorithm == "EAGLE3":
            from pcgspec.models.default_model import default_eagle3_head

            return str(default_eagle3_head(target_model))
        return None

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        path = self.speculative_draft_model_path
        if path is not None and (not isinstance(path, str) or not path):
            raise bad("speculative_draft_model_path", "must be a non-empty path")
        if self.algorithm in _NEEDS_DRAFT_MODEL and path is None:
            raise bad("speculative_draft_model_path", f"is required by {self.algorithm}")
        if self.algorithm == "NGRAM" and path is not None:
            raise bad("speculative_draft_model_path", "is not used by NGRAM")
        for name in (
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_ngram_min_match_window_size",
        ):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "must be an integer >= 1")
        if self.speculative_policy not in POLICIES:
            raise bad("speculative_policy", f"must be one of {', '.join(POLICIES)}")
        if self.speculative_eagle_topk > 1:
            raise bad("speculative_eagle_topk", "> 1 needs tree drafting, not supported yet")
        if self.speculative_num_draft_tokens != self.num_steps + 1:
            raise bad(
                "speculative_num_draft_tokens",
                f"must be speculative_num_steps + 1 = "
                f"{self.num_steps + 1} with speculative_eagle_topk 1",
            )
        max_window = self.speculative_ngram_max_match_window_size
        if not _is_int(max_window) or max_window < self.speculative_ngram_min_match_window_size:
            raise bad(
                "speculative_ngram_max_match_window_size",
                "must be an integer >= speculative_ngram_min_match_window_size "
                f"({self.speculative_ngram_min_match_window_size})",
            )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
