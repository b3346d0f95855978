"""Speculative decoding configuration, with SGLang's option names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# the most draft-tree nodes kept past the root, and the largest topk: one top-k keeps them
# (kernels/top_k.py unrolls its k rounds)
MAX_TREE_WIDTH = 64

SUPPORTED_ALGORITHMS = ("EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
POLICIES = ("auto", "always")
TREE_ALGORITHMS = ("EAGLE3", "NEXTN")  # heads that expand top-k per depth
_NEEDS_DRAFT_MODEL = ("STANDALONE",)  # EAGLE3 of the default model: its shipped head
# k when not given, per method, from served chat on one H200 (SmolLM2-135M-Instruct, k = 2..5,
# docs/speculative.md): the shipped EAGLE3 head served fastest at k=3 with 1 and 4 requests in
# flight; prompt lookup at k=4 matched the best on chat and led on text that repeats. NEXTN and
# STANDALONE (no head or pair of the default model to measure) keep the chain of 3.
DEFAULT_NUM_STEPS = {"EAGLE3": 3, "NEXTN": 3, "STANDALONE": 3, "NGRAM": 4}
# EAGLE3 given none of num_steps, eagle_topk, num_draft_tokens drafts this tree (depth, topk,
# nodes), from served chat on H200s (SmolLM2-135M-Instruct and its shipped head, greedy and
# T=0.7, docs/speculative.md): 5/4/16 served 2.0x plain at 1 request in flight against the
# chain's 1.7x, and ahead of the chain at 16 and 64; 6/4/24 accepted more for no more speed.
DEFAULT_TREE = {"EAGLE3": (5, 4, 16)}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft and verify. ``speculative_num_steps`` (k) is the draft depth: the most
    drafts a request can accept per step. With ``speculative_eagle_topk`` 1 the drafts are a
    chain and the target scores ``speculative_num_draft_tokens`` = k+1 tokens per request; with
    topk > 1 (EAGLE3 / NEXTN) the head expands the topk best tokens per depth and the target
    verifies a tree of ``speculative_num_draft_tokens`` nodes (the root, the request's last
    token, included), at most ``1 + topk + (k - 1) * topk**2`` (the candidates drafted).
    """

    speculative_algorithm: str  # EAGLE3, NEXTN, STANDALONE or NGRAM (any case)
    speculative_draft_model_path: str | None = None  # NEXTN: None = the target's own MTP layers
    # all three None: DEFAULT_TREE of the algorithm, where it has one
    speculative_num_steps: int | None = None  # None = DEFAULT_NUM_STEPS of the algorithm
    speculative_num_draft_tokens: int | None = None  # None = num_steps + 1
    speculative_eagle_topk: int | None = None  # None = 1 (a chain)
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
        shape = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
        if self.algorithm in DEFAULT_TREE and all(getattr(self, f) is None for f in shape):
            for name, value in zip(shape, DEFAULT_TREE[self.algorithm], strict=True):
                object.__setattr__(self, name, value)
        if self.speculative_eagle_topk is None:
            object.__setattr__(self, "speculative_eagle_topk", 1)
        if self.speculative_num_steps is None:
            object.__setattr__(self, "speculative_num_steps", DEFAULT_NUM_STEPS[self.algorithm])
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
        """k: the draft depth (chain: draft tokens proposed per request and step)."""
        return self.speculative_num_steps

    @property
    def topk(self) -> int:
        return self.speculative_eagle_topk

    @property
    def num_draft_tokens(self) -> int:
        """N: tokens the target verifies per request and step (tree nodes, root included)."""
        return self.speculative_num_draft_tokens  # type: ignore[return-value]

    @property
    def slots_ahead(self) -> int:
        """KV slots past a request's tokens that one step writes: the verify pass's N - 1,
        or the draft's tree levels, (k - 1) * topk, where more.
        """
        return max(self.num_draft_tokens - 1, (self.num_steps - 1) * self.topk)

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

    def _validate_tree(self) -> None:
        if self.topk > 1 and self.algorithm not in TREE_ALGORITHMS:
            raise ValueError(
                f"speculative_eagle_topk > 1 (tree drafting) needs one of "
                f"{', '.join(TREE_ALGORITHMS)}, not {self.algorithm}, got {self.topk!r}"
            )
        _validate_tree_shape(self)

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
        self._validate_tree()
        max_window = self.speculative_ngram_max_match_window_size
        if not _is_int(max_window) or max_window < self.speculative_ngram_min_match_window_size:
            raise bad(
                "speculative_ngram_max_match_window_size",
                "must be an integer >= speculative_ngram_min_match_window_size "
                f"({self.speculative_ngram_min_match_window_size})",
            )


def _validate_tree_shape(spec: SpeculativeConfig) -> None:
    """N fits the drafting: k+1 for a chain, 2 .. 1 + topk + (k-1) * topk**2 for a tree."""
    n, k, topk = spec.speculative_num_draft_tokens, spec.num_steps, spec.topk
    if not _is_int(n):
        raise ValueError(f"speculative_num_draft_tokens must be an integer, got {n!r}")
    if topk == 1 and n != k + 1:
        raise ValueError(
            f"speculative_num_draft_tokens must be speculative_num_steps + 1 = {k + 1} with "
            f"speculative_eagle_topk 1, got {n!r}"
        )
    most = min(1 + topk + (k - 1) * topk * topk, MAX_TREE_WIDTH + 1)
    if topk > MAX_TREE_WIDTH:
        raise ValueError(f"speculative_eagle_topk must be at most {MAX_TREE_WIDTH}, got {topk!r}")
    if topk > 1 and not 2 <= n <= most:
        raise ValueError(
            f"speculative_num_draft_tokens must be in 2..{most} (1 + topk + (num_steps - 1) * "
            f"topk**2 candidates, at most {MAX_TREE_WIDTH + 1} nodes) with "
            f"speculative_eagle_topk {topk} and speculative_num_steps {k}, got {n!r}"
        )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
