"""NEXTN / MTP draft head: one multi-token-prediction layer of the target's architecture.

``x = eh_proj(cat(enorm(embed(token)), hnorm(hidden)))``, one decoder block, a final norm, and
the target's embedding and LM head. Two checkpoint layouts, told apart by tensor names:

- ``deepseek`` (DeepSeek-V3): ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}`` and
  the block under ``model.layers.{L}.``; concat order [embeds; hidden]; ``next_hidden`` is the
  pre-norm block output (as vLLM chains it). ``embed_tokens`` / ``shared_head.head`` copies of
  the target's tensors are ignored.
- ``mimo`` (MiMo-7B, in the target's own checkpoint): ``model.mtp_layers.{i}.{token_layernorm,
  hidden_layernorm,input_proj,final_layernorm}`` and the block beside them; concat order
  [hidden; embeds]; ``next_hidden`` is the final-normed output. Layer 0 is used.

The embedding at position 0 is zeroed (no previous token there), as vLLM and SGLang do for MiMo.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pcgspec.models.draft_checkpoint import (
    config_dict,
    hf_tensor_shapes,
    random_tensors,
    save_checkpoint,
)
from pcgspec.models.draft_head import (
    DraftHead,
    build_head,
    check_tensor_names,
    finish_loading,
    read_tensors,
    tensor_names,
)
from pcgspec.models.layers.linear import float_matmul
from pcgspec.models.layers.norm import RMSNorm
from pcgspec.models.layers.weights import checkpoint_parameter_names, load_named_weights
from pcgspec.models.llama import LlamaDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MTP_LAYOUTS = ("deepseek", "mimo")
MIMO_ARCHITECTURE = "MiMoForCausalLM"
# our module -> the layout's name for it, under the layer prefix; the block's names are the
# target's decoder-layer names ("block." dropped)
_SPECIAL_NAMES = {
    "deepseek": {
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "final_norm": "shared_head.norm",
    },
    "mimo": {
        "enorm": "token_layernorm",
        "hnorm": "hidden_layernorm",
        "eh_proj": "input_proj",
        "final_norm": "final_layernorm",
    },
}
_IGNORED = {"deepseek": ("embed_tokens.weight", "shared_head.head.weight"), "mimo": ()}
_DEEPSEEK_LAYER = re.compile(r"model\.layers\.(\d+)\.enorm\.weight")


@dataclass(frozen=True)
class MtpLayout:
    name: str  # "deepseek" | "mimo"
    prefix: str  # the MTP layer's tensors: "model.layers.61." | "model.mtp_layers.0."


def detect_mtp_layout(names: Iterable[str]) -> MtpLayout:
    """The layout of a checkpoint from its tensor names; ``ValueError`` when it has no MTP layer."""
    names = list(names)
    if any(name.startswith("model.mtp_layers.") for name in names):
        return MtpLayout("mimo", "model.mtp_layers.0.")
    layers = sorted(int(m.group(1)) for name in names if (m := _DEEPSEEK_LAYER.fullmatch(name)))
    if layers:
        return MtpLayout("deepseek", f"model.layers.{layers[0]}.")
    raise ValueError(
        "no MTP layer in the checkpoint: expected DeepSeek-style tensors "
        "'model.layers.{L}.enorm.weight' or MiMo-style 'model.mtp_layers.{i}.*'"
    )


class MtpHead(DraftHead):
    def __init__(self, target: nn.Module, layout: MtpLayout) -> None:
        if layout.name not in MTP_LAYOUTS:
            raise ValueError(f"MTP layout must be one of {MTP_LAYOUTS}, got {layout.name!r}")
        config = target.config
        super().__init__(config, target)
        self.layout = layout
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = LlamaDecoderLayer(config, 0, type(target).attention_flags(config))
        self.final_norm = RMSNorm(hidden, eps)

    def target_aux_layers(self, target_num_layers: int) -> tuple[int, ...] | None:
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.shared.embed_tokens(input_ids)  # [T, H]
        embeds = embeds.masked_fill(positions[:, None] == 0, 0.0)
        e, h = self.enorm(embeds), self.hnorm(hidden)
        mimo = self.layout.name == "mimo"
        x = self.eh_proj(torch.cat([h, e] if mimo else [e, h], dim=-1))
        cos, sin = self.rotary_emb(positions)
        y = self.block(x, cos.to(x.dtype), sin.to(x.dtype))  # [T, H] pre-norm
        normed = self.final_norm(y)
        return normed, normed if mimo else y

    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        return float_matmul(logits_hidden, self.shared.lm_head.weight)

    def checkpoint_names(self) -> dict[str, str]:
        special = _SPECIAL_NAMES[self.layout.name]
        names: dict[str, str] = {}
        for name in checkpoint_parameter_names(self, self.packed_modules_mapping):
            module, _, rest = name.partition(".")
            inner = rest if module == "block" else f"{special[module]}.{rest}"
            names[self.layout.prefix + inner] = name
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the MTP layer's tensors, named as in the checkpoint (other tensors raise)."""
        ours = self.checkpoint_names()

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name not in ours:
                    raise ValueError(f"unexpected weight {name!r} for {self.layout.name} MTP head")
                yield ours[name], tensor

        load_named_weights(self, renamed(), self.packed_modules_mapping)
        finish_loading(self)


def load_mtp_head(
    path: str | Path, target: nn.Module, dtype: torch.dtype, device: torch.device | str
) -> MtpHead:
    """The MTP head in folder ``path`` (a draft folder, or the target's own for MiMo) for
    ``target``, in eval mode without gradients. Only the MTP layer's tensors are read.
    """
    from pcgspec.models.loader import resolve_model_dir, safetensors_files

    folder = resolve_model_dir(path)
    where = tensor_names(safetensors_files(folder))
    layout = detect_mtp_layout(where)
    head = build_head(lambda: MtpHead(target, layout), dtype, device)
    names = head.checkpoint_names()
    provided = [name for name in where if name.startswith(layout.prefix)]
    ignored = [layout.prefix + name for name in _IGNORED[layout.name]]
    where_msg = f"{folder} ({layout.name} MTP layer {layout.prefix!r})"
    check_tensor_names(provided, names, where_msg, optional=ignored)
    head.load_weights(read_tensors(where, names))
    return head


def write_mtp_checkpoint(
    out_dir: str | Path, target_config: PretrainedConfig, seed: int, layout: str = "deepseek"
) -> Path:
    """An untrained MTP layer for a target of ``target_config`` (float32 safetensors).

    ``deepseek``: a draft folder (the target's config plus ``num_nextn_predict_layers``) holding
    only ``model.layers.{L}.*``, ``L`` = the target's layer count. ``mimo``: a whole MiMo
    checkpoint (a Qwen2 of the target's shape, random weights, ``model_type`` "mimo") with its
    MTP layer under ``model.mtp_layers.0.``, to load both as target and as MTP head.
    """
    if layout not in MTP_LAYOUTS:
        raise ValueError(f"layout must be one of {MTP_LAYOUTS}, got {layout!r}")
    generator = torch.Generator().manual_seed(seed)
    mimo = layout == "mimo"
    config = _mimo_config(target_config) if mimo else copy.deepcopy(target_config)
    config.num_nextn_predict_layers = 1
    shapes = hf_tensor_shapes(config)
    prefix = "model.mtp_layers.0." if mimo else f"model.layers.{config.num_hidden_layers}."
    mtp_shapes = {
        prefix + name[len("model.layers.0.") :]: shape
        for name, shape in shapes.items()
        if name.startswith("model.layers.0.")
    }
    hidden = config.hidden_size
    for module, name in _SPECIAL_NAMES[layout].items():
        shape = (hidden, 2 * hidden) if module == "eh_proj" else (hidden,)
        mtp_shapes[f"{prefix}{name}.weight"] = shape
    tensors = random_tensors(shapes, generator) if mimo else {}
    tensors.update(random_tensors(mtp_shapes, generator))
    published = config_dict(config)
    if mimo:
        published["model_type"] = "mimo"
    return save_checkpoint(out_dir, published, tensors)


def _mimo_config(config: PretrainedConfig) -> PretrainedConfig:
    """A Qwen2 config of ``config``'s shape naming the MiMo architecture."""
    from transformers import AutoConfig

    fields = config_dict(config)
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    return AutoConfig.for_model("qwen2", **{**fields, "architectures": [MIMO_ARCHITECTURE]})
