"""Load the draft of a model-based speculative algorithm, next to an already loaded target."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from pcgspec.config import EngineConfig
from pcgspec.models.loader import load_model, load_tokenizer, resolve_model_dir
from pcgspec.models.registry import DRAFT_HEAD_REGISTRY
from pcgspec.speculative.config import SpeculativeConfig
from pcgspec.speculative.draft_runner import StandaloneDraft


def load_draft(spec: SpeculativeConfig, config: EngineConfig, target: nn.Module) -> nn.Module:
    """The draft for ``spec`` (EAGLE3 / NEXTN heads share the target's embedding and LM head)."""
    path = spec.draft_model_path(config.model)
    dtype, device = config.torch_dtype, config.torch_device
    if spec.algorithm == "STANDALONE":
        draft = load_model(path, dtype, device)
        check_same_vocabulary(path, config, draft, target)
        return StandaloneDraft(draft)
    load_head = DRAFT_HEAD_REGISTRY.get(spec.algorithm)  # EAGLE3, NEXTN
    return load_head(resolve_model_dir(path), target, dtype, device)


def check_same_vocabulary(
    draft_path: str | None, config: EngineConfig, draft: nn.Module, target: nn.Module
) -> None:
    """A standalone draft must speak the target's token ids: same vocabulary size and, where
    both folders carry a tokenizer, the same token -> id map.
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_draft_model_path {draft_path!r} has a vocabulary of "
            f"{draft.vocab_size} tokens but the target has {target.vocab_size}"
        )
    folders = [resolve_model_dir(draft_path), config.tokenizer or resolve_model_dir(config.model)]
    if not all((Path(f) / "tokenizer_config.json").is_file() for f in folders):
        return
    draft_vocab, target_vocab = (load_tokenizer(f).get_vocab() for f in folders)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_draft_model_path {draft_path!r} has another tokenizer than the target "
            "(the token -> id maps differ)"
        )
