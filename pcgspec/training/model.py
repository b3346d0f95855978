"""The EAGLE3 head in training: the inference module (``Eagle3Head``, so the published tensor
names and the same layers) unrolled over whole sequences with training-time test (TTT).

Pairing, as at inference (``speculative/model_proposer.py``): step 0, row ``t`` reads the
target's aux states of position ``t`` (through ``fc``) with the embedding of token ``t+1`` at
position ``t`` and predicts token ``t+2``. Step ``i`` reads the head's own output hidden of row
``t`` at step ``i-1`` with token ``t+1+i`` at position ``t+i`` and predicts token ``t+2+i``. Its
query attends to the step-0 keys of rows ``<= t`` and to the keys of steps ``1..i`` of row ``t``
only: what a chain draft step sees in the draft KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pcgspec.models.draft_checkpoint import save_checkpoint
from pcgspec.models.eagle3 import Eagle3Head, published_config
from pcgspec.models.layers.weights import unfused_state_dict

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def build_trainable_head(
    target: nn.Module,
    draft_ids: torch.Tensor,
    aux_layers: Sequence[int],
    seed: int,
    intermediate_size: int | None = None,
) -> Eagle3Head:
    """A fresh float32 head for ``target`` on its device: draft vocabulary ``draft_ids`` (sorted
    target ids), reading the inputs of target layers ``aux_layers``, its MLP
    ``intermediate_size`` wide (default: the target's); ``lm_head`` starts as the target's rows
    of the draft vocabulary. The target's embedding is shared, frozen, not saved.
    """
    from transformers import LlamaConfig

    published = head_config(target.config, draft_ids, aux_layers)
    if intermediate_size is not None:
        published["intermediate_size"] = intermediate_size
    config = LlamaConfig(**published)
    torch.manual_seed(seed)
    head = Eagle3Head(config, target, own_embedding=False, own_lm_head=True)
    ids = draft_ids.long()
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.device)].float().cpu())
    head.set_vocab_map(ids - torch.arange(len(ids)), None)
    head.to(device=target.device)
    head.rotary_emb.init_rope()
    for module in (target.model.embed_tokens, target.lm_head):
        module.requires_grad_(False)
    return head.train()


def head_config(
    target_config: PretrainedConfig, draft_ids: torch.Tensor, aux_layers: Sequence[int]
) -> dict:
    """The published ``config.json``; aux layers are stored as layer outputs (inputs - 1)."""
    return published_config(target_config, len(draft_ids), [i - 1 for i in aux_layers])


def export_head(head: Eagle3Head, out_dir: str | Path) -> Path:
    """``out_dir`` in the published ``LlamaForCausalLMEagle3`` layout, weights in bfloat16."""
    weights = unfused_state_dict(head, head.packed_modules_mapping)
    tensors = {name: t.to(torch.bfloat16).cpu() for name, t in weights.items()}
    ids = head.draft_to_target.cpu()
    tensors["d2t"] = ids - torch.arange(len(ids))
    tensors["t2d"] = torch.zeros(head.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    config = published_config(head.config, head.draft_vocab_size, head.aux_layer_ids)
    return save_checkpoint(out_dir, config, tensors)


def unroll(
    head: Eagle3Head,
    input_ids: torch.Tensor,  # [B, T]
    aux: torch.Tensor,  # [B, T, 3H]
    seq: torch.Tensor,  # [B, T] which sequence of its line
    positions: torch.Tensor,  # [B, T] within the sequence
    num_steps: int,
) -> Iterator[torch.Tensor]:
    """Yield the draft logits ``[B, n, draft_vocab]`` of TTT steps ``0..num_steps-1`` for lines
    of packed sequences ``input_ids`` with the target's aux states ``aux``; ``n = T - 1``
    rows. A row whose token runs past its sequence reads the next sequence's token (or token
    0 past the line's end), which the loss masks out.
    """
    batch, n = input_ids.shape[0], input_ids.shape[1] - 1
    hidden = head.fc(aux[:, :n].to(head.fc.weight.dtype))  # [B, n, H]
    rows = torch.arange(n, device=input_ids.device)
    # [B, n, n] step-0 keys of rows <= t of the same sequence
    causal = (rows[:, None] >= rows[None, :]) & (seq[:, :n, None] == seq[:, None, :n])
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    layer = head.midlayer
    for step in range(num_steps):
        tokens = shifted(input_ids, 1 + step, n)  # [B, n]
        embeds = head.shared.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = head.rotary_emb((positions[:, :n] + step).reshape(-1))  # [B * n]
        flat_hidden = hidden.reshape(batch * n, -1)
        x = layer.attention_input(embeds.reshape(batch * n, -1), flat_hidden)
        q, k, v = layer.self_attn.project(x, cos.to(x.dtype), sin.to(x.dtype))
        keys.append((k.view(batch, n, *k.shape[1:]), v.view(batch, n, *v.shape[1:])))
        out = ttt_attention(q.view(batch, n, *q.shape[1:]), keys, causal, head.attn_scale)
        h = layer.finish(flat_hidden, layer.self_attn.o_proj(out))  # [B * n, H]
        yield head.lm_head(head.norm(h)).view(batch, n, -1)
        hidden = h.view(batch, n, -1)


def ttt_attention(
    q: torch.Tensor,  # [B, n, heads, D]
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per step: k, v [B, n, kv_heads, D]
    causal: torch.Tensor,  # [B, n, n] bool
    scale: float,
) -> torch.Tensor:
    """``[B * n, heads * D]``: row ``t`` attends to step 0's rows ``causal[:, t]`` and to row
    ``t`` of every later step (the diagonal), one softmax over both. Query heads are grouped
    over their KV head (a view: no key is repeated), the later steps' keys stacked.
    """
    batch, n, heads, dim = q.shape
    kv_heads = kv[0][0].shape[2]
    qg = q.view(batch, n, kv_heads, heads // kv_heads, dim)  # [B, n, KV, G, D]
    k0, v0 = kv[0]
    scores = torch.einsum("bikgd,bjkd->bkgij", qg, k0) * scale  # [B, KV, G, n, n]
    scores = scores.masked_fill(~causal[:, None, None], float("-inf"))
    later = len(kv) - 1
    if later:
        ks = torch.stack([k for k, _ in kv[1:]], dim=3)  # [B, n, KV, S, D]
        vs = torch.stack([v for _, v in kv[1:]], dim=3)
        diag = torch.einsum("bikgd,biksd->bkgis", qg, ks) * scale  # [B, KV, G, n, S]
        scores = torch.cat([scores, diag], dim=-1)
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    out = torch.einsum("bkgij,bjkd->bikgd", probs[..., :n], v0)  # [B, n, KV, G, D]
    if later:
        out = out + torch.einsum("bkgis,biksd->bikgd", probs[..., n:], vs)
    return out.reshape(batch * n, heads * dim)


def shifted(x: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """``x[:, offset : offset + length]`` zero-padded on the right to ``length`` columns."""
    part = x[:, offset : offset + length]
    pad = length - part.shape[1]
    if pad <= 0:
        return part
    return F.pad(part, (0, 0) * (x.dim() - 2) + (0, pad))
