"""EAGLE3 draft head in the published ``LlamaForCausalLMEagle3`` layout.

Tensors: ``fc.weight`` [H, 3H] over the target's three auxiliary hidden states; ``midlayer.*``,
one decoder layer whose attention projects [input_layernorm(embeds); hidden_norm(hidden)] (2H);
``norm.weight``; ``lm_head.weight`` [draft_vocab, H]; ``d2t`` (target id = draft id +
d2t[draft id]) and ``t2d`` (bool over the target vocabulary); ``embed_tokens.weight`` only when
the head does not reuse the target's embedding (likewise ``lm_head.weight`` may be absent when
the draft vocabulary is the target's).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pcgspec.models.draft_checkpoint import random_tensors, save_checkpoint
from pcgspec.models.draft_head import (
    DraftHead,
    build_head,
    finish_loading,
    read_tensors,
    tensor_names,
)
from pcgspec.models.layers.linear import MergedLinear, float_matmul
from pcgspec.models.layers.norm import RMSNorm
from pcgspec.models.layers.rotary import rope_parameters
from pcgspec.models.layers.weights import load_named_weights
from pcgspec.models.llama import (
    AttentionFlags,
    LlamaAttention,
    LlamaMLP,
    check_config,
    head_dim_of,
)
from pcgspec.speculative.tree import top_tokens

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from transformers import PretrainedConfig

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_AUX_LAYERS = 3
VOCAB_MAP_TENSORS = ("d2t", "t2d")


class Eagle3DecoderLayer(nn.Module):
    """``midlayer``: a Llama layer whose attention reads [embeds; hidden] (2H wide)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, 0, AttentionFlags(qkv_bias=bias, o_bias=bias))
        self.self_attn.qkv_proj = MergedLinear(2 * hidden, self.self_attn.split_sizes, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The residual stream after the layer (pre-norm), [T, H]."""
        return self.finish(hidden, self.self_attn(self.attention_input(embeds, hidden), cos, sin))

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, 2H]``: what the attention projects (also the trainer's, ``pcgspec.training``)."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention output ``attn_out`` and the MLP, [T, H]."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(DraftHead):
    def __init__(
        self, config: PretrainedConfig, target: nn.Module, own_embedding: bool, own_lm_head: bool
    ) -> None:
        super().__init__(config, target)
        eagle = _eagle_config(config)
        self.use_aux_hidden_state = bool(eagle.get("use_aux_hidden_state", True))
        self.aux_layer_ids = _config_aux_ids(config, eagle)
        self.draft_vocab_size: int = getattr(config, "draft_vocab_size", None) or config.vocab_size
        _check_eagle3_config(config, target, self.draft_vocab_size)
        hidden, width = config.hidden_size, target.hidden_size
        if self.use_aux_hidden_state:
            self.target_hidden_size = NUM_AUX_LAYERS * width
            bias = bool(getattr(config, "bias", False))
            self.fc = nn.Linear(self.target_hidden_size, hidden, bias=bias)
        elif width != hidden:
            raise ValueError(
                f"use_aux_hidden_state=False needs hidden_size {hidden} == the "
                f"target's hidden size {width}"
            )
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(self.vocab_size, hidden) if own_embedding else None
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False) if own_lm_head else None
        _check_shared(self, target, own_embedding, own_lm_head)
        self.register_buffer(
            "draft_to_target", torch.arange(self.draft_vocab_size), persistent=False
        )  # [draft_vocab] target id of each draft id
        self.identity_vocab = True  # draft ids are target ids: no scatter in compute_logits
        # ``decode`` compiled into pieces around its attention (set by the draft runner)
        self.compiled_decoder: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def target_aux_layers(self, target_num_layers: int) -> tuple[int, ...] | None:
        if not self.use_aux_hidden_state:
            return None
        n = target_num_layers
        if self.aux_layer_ids is None:
            return default_aux_layers(n)
        bad = [i for i in self.aux_layer_ids if not -1 <= i < n]
        if bad:
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)}: "
                f"{bad} are not outputs of layers -1..{n - 1}"
            )
        return tuple(i + 1 for i in self.aux_layer_ids)  # output of layer i = input of layer i+1

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden)  # [T, 3 * H_target] -> [T, H]
        return (self.compiled_decoder or self.decode)(input_ids, positions, hidden)

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` past the fc: ``hidden`` [T, H]. What ``compiled_decoder`` compiles (one
        signature: the catch-up's wide target states go through the fc first).
        """
        embed = self.shared.embed_tokens if self.embed_tokens is None else self.embed_tokens
        embeds = embed(input_ids)  # [T, H]
        cos, sin = self.rotary_emb(positions)
        h = self.midlayer(embeds, hidden, cos.to(embeds.dtype), sin.to(embeds.dtype))
        return self.norm(h), h

    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.shared.lm_head if self.lm_head is None else self.lm_head
        logits = float_matmul(logits_hidden, lm_head.weight)  # [R, draft_vocab]
        if self.identity_vocab:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target, logits)

    def top_tokens(self, logits_hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, H] -> ([R, k], [R, k])``: the best ``k`` target ids of the draft vocabulary
        and their log-probabilities (no scatter to the target vocabulary)."""
        lm_head = self.shared.lm_head if self.lm_head is None else self.lm_head
        scores, ids = top_tokens(F.linear(logits_hidden, lm_head.weight), k)
        return scores, (ids if self.identity_vocab else self.draft_to_target[ids])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in the published checkpoint; every parameter must be filled."""
        vocab_map: dict[str, torch.Tensor] = {}

        def without_vocab_map() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in VOCAB_MAP_TENSORS:
                    vocab_map[name] = tensor
                else:
                    yield name, tensor

        load_named_weights(self, without_vocab_map(), self.packed_modules_mapping)
        self.set_vocab_map(vocab_map.get("d2t"), vocab_map.get("t2d"))
        finish_loading(self)

    def set_vocab_map(self, d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> None:
        """The draft vocabulary from ``d2t`` (None: the whole vocabulary), checked against
        ``t2d`` when given.
        """
        ids = _target_ids(d2t, self.draft_vocab_size, self.vocab_size)
        if t2d is not None:
            expected = torch.zeros(self.vocab_size, dtype=torch.bool)
            expected[ids] = True
            if t2d.shape != expected.shape or not torch.equal(t2d.bool(), expected):
                raise ValueError(
                    f"'t2d' {list(t2d.shape)} is not the [{self.vocab_size}] mask "
                    "of the target ids that 'd2t' maps to"
                )
        self.draft_to_target.copy_(ids)
        self.identity_vocab = torch.equal(ids, torch.arange(self.vocab_size))


def default_aux_layers(target_num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE3 head reads by default: 2, L//2 and L-3."""
    n = target_num_layers
    # NOTE: clamped into 0..L so that targets of fewer than 5 layers (tests) still work
    return tuple(min(max(i, 0), n) for i in (2, n // 2, n - 3))


def load_eagle3_head(
    path: str | Path, target: nn.Module, dtype: torch.dtype, device: torch.device | str
) -> Eagle3Head:
    """The EAGLE3 head in folder ``path`` for ``target``, in eval mode without gradients."""
    from pcgspec.models.loader import load_config, resolve_model_dir, safetensors_files

    folder = resolve_model_dir(path)
    config = load_config(folder)
    architectures = list(getattr(config, "architectures", None) or [])
    if EAGLE3_ARCHITECTURE not in architectures:
        raise ValueError(
            f"{folder}: architectures {architectures} do not name {EAGLE3_ARCHITECTURE!r}"
        )
    where = tensor_names(safetensors_files(folder))
    own_embed, own_head = "embed_tokens.weight" in where, "lm_head.weight" in where
    head = build_head(lambda: Eagle3Head(config, target, own_embed, own_head), dtype, device)
    head.load_weights(read_tensors(where, where))
    return head


def write_eagle3_checkpoint(
    out_dir: str | Path,
    target_config: PretrainedConfig,
    seed: int,
    draft_vocab_size: int | None = None,
    include_embedding: bool = False,
) -> Path:
    """An untrained EAGLE3 head for ``target_config`` in the published layout: ``config.json``
    and ``model.safetensors`` (float32), with a random valid ``d2t``/``t2d`` over
    ``draft_vocab_size`` target ids (default: the whole vocabulary, identity map).
    """
    vocab = target_config.vocab_size
    draft_vocab = draft_vocab_size or vocab
    if not 0 < draft_vocab <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    shapes = _published_shapes(target_config, draft_vocab, include_embedding)
    tensors = random_tensors(shapes, generator)
    target_ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    tensors["d2t"] = target_ids - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True)
    return save_checkpoint(out_dir, published_config(target_config, draft_vocab), tensors)


def _eagle_config(config: PretrainedConfig) -> dict:
    return dict(getattr(config, "eagle_config", None) or {})


def _config_aux_ids(config: PretrainedConfig, eagle: dict) -> tuple[int, ...] | None:
    """``eagle_aux_hidden_state_layer_ids`` from ``eagle_config`` (SGLang) or the top level."""
    key = "eagle_aux_hidden_state_layer_ids"
    ids = eagle.get(key, getattr(config, key, None))
    if ids is None:
        return None
    if len(ids) != NUM_AUX_LAYERS:
        raise ValueError(f"{key} must name {NUM_AUX_LAYERS} layers, got {list(ids)}")
    return tuple(int(i) for i in ids)


def _check_eagle3_config(config: PretrainedConfig, target: nn.Module, draft_vocab: int) -> None:
    check_config(config)
    if config.num_hidden_layers != 1:
        raise ValueError(
            f"num_hidden_layers={config.num_hidden_layers}: only one-layer EAGLE3 "
            "heads are supported"
        )
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"vocab_size {config.vocab_size} differs from the target's {target.vocab_size}"
        )
    if not 0 < draft_vocab <= config.vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab} must be in 1..{config.vocab_size}")
    width = getattr(config, "target_hidden_size", None) or config.hidden_size
    if width != target.hidden_size:
        raise ValueError(
            f"target_hidden_size {width} differs from the target's hidden size {target.hidden_size}"
        )


def _check_shared(head: Eagle3Head, target: nn.Module, own_embed: bool, own_head: bool) -> None:
    borrowed = [
        name
        for name, own in (("embed_tokens.weight", own_embed), ("lm_head.weight", own_head))
        if not own
    ]
    if borrowed and target.hidden_size != head.hidden_size:
        raise ValueError(
            f"no {borrowed} in the checkpoint to replace the target's, whose width "
            f"{target.hidden_size} != hidden_size {head.hidden_size}"
        )
    if not own_head and head.draft_vocab_size != head.vocab_size:
        raise ValueError(
            f"no lm_head.weight in the checkpoint but draft_vocab_size "
            f"{head.draft_vocab_size} != vocab_size {head.vocab_size}"
        )


def _target_ids(d2t: torch.Tensor | None, draft_vocab: int, vocab: int) -> torch.Tensor:
    """[draft_vocab] int64 target id of each draft id, checked to be distinct and in range."""
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(
                f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but the "
                "checkpoint has no 'd2t'"
            )
        return torch.arange(vocab)
    if d2t.shape != (draft_vocab,) or d2t.is_floating_point():
        raise ValueError(
            f"'d2t' must be [{draft_vocab}] integers, got {list(d2t.shape)} {d2t.dtype}"
        )
    ids = torch.arange(draft_vocab) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != draft_vocab:
        raise ValueError(f"'d2t' must map draft ids to distinct target ids in 0..{vocab - 1}")
    return ids


def _published_shapes(
    config: PretrainedConfig, draft_vocab: int, include_embedding: bool
) -> dict[str, Sequence[int]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * head_dim_of(config)
    kv = config.num_key_value_heads * head_dim_of(config)
    shapes: dict[str, Sequence[int]] = {
        "fc.weight": (hidden, NUM_AUX_LAYERS * hidden),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, q),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.mlp.gate_proj.weight": (inter, hidden),
        "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
    }
    if include_embedding:
        shapes["embed_tokens.weight"] = (config.vocab_size, hidden)
    return shapes


def published_config(
    config: PretrainedConfig, draft_vocab: int, aux_layer_ids: Sequence[int] | None = None
) -> dict:
    """``config.json`` of a head for target ``config``; ``aux_layer_ids`` (outputs of layers,
    ``eagle_aux_hidden_state_layer_ids``) go into ``eagle_config`` when given.
    """
    rope = rope_parameters(config)
    copied = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    published = {key: getattr(config, key) for key in copied} | {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "head_dim": head_dim_of(config),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_theta": rope["rope_theta"],
    }
    if rope["rope_type"] != "default":
        published["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if aux_layer_ids is not None:
        published["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    return published
