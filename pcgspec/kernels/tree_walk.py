"""The walk of draft trees in verification (``verify_draft_tokens(parents=...)``): from each
root, move to the child whose token is the target's choice after its parent while there is
one; the last node's choice is the next token. Triton kernel, launch, torch reference.

Siblings carry distinct tokens (the top-k of one distribution), so at most one child matches;
``num_draft[b]`` nodes are real, the rest never accepted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches


@triton.jit(
    do_not_specialize_on_alignment=[
        "Cand",
        "Draft",
        "Parents",
        "NumDraft",
        "AcceptLen",
        "Out",
        "Path",
    ]
)
def _accept_tree_kernel(
    Cand,
    Draft,
    Parents,
    NumDraft,
    AcceptLen,
    Out,
    Path,
    N,
    DEPTH: tl.constexpr,
    HAS_NUM_DRAFT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)  # nodes
    valid = (i >= 1) & (i < N)
    if HAS_NUM_DRAFT:
        valid = valid & (i <= tl.load(NumDraft + b).to(tl.int32))
    par = tl.load(Parents + b * N + i, mask=valid, other=-1).to(tl.int32)
    tok = tl.load(Draft + b * (N - 1) + i - 1, mask=valid, other=-1)
    target = tl.load(Cand + b * N + par, mask=valid & (par >= 0), other=-2)
    ok = valid & (tok == target)  # the target's choice after the parent is this node's token
    d = tl.arange(0, BLOCK_D)  # output positions
    out = tl.full([BLOCK_D], -1, tl.int64)
    path = tl.where(d == 0, 0, -1).to(tl.int64)
    cur = tl.min(tl.zeros([BLOCK_N], tl.int32), 0)
    alive = cur == 0
    accept_len = cur
    for step in range(DEPTH):
        child = tl.min(tl.where(ok & (par == cur), i, BLOCK_N), 0)  # NOTE: siblings differ
        found = alive & (child < BLOCK_N)
        token = tl.sum(tl.where(i == child, tok, 0), 0)
        out = tl.where((d == step) & found, token, out)
        path = tl.where((d == step + 1) & found, child.to(tl.int64), path)
        cur = tl.where(found, child, cur)
        accept_len += found.to(tl.int32)
        alive = found
    out = tl.where(d == accept_len, tl.load(Cand + b * N + cur), out)
    tl.store(Out + b * (DEPTH + 1) + d, out, mask=d <= DEPTH)
    tl.store(Path + b * (DEPTH + 1) + d, path, mask=d <= DEPTH)
    tl.store(AcceptLen + b, accept_len.to(tl.int64))


# NOTE: one launch per verify step: without Triton's binder, as the other verify launches.
_WALK = CompiledLaunches(_accept_tree_kernel)


def check_tree(
    parents: torch.Tensor | None, max_depth: int | None, matching: bool, b: int, n: int
) -> int:
    """``max_depth`` of trees ``parents`` [B, N] (checked); ``matching``: the strategy
    accepts a draft by its token (GREEDY, TARGET_MATCH), as trees need."""
    if parents is None:
        raise ValueError("max_depth is for draft trees (parents) only")
    if tuple(parents.shape) != (b, n) or parents.dtype != torch.int64:
        raise ValueError(
            f"parents must be [{b}, {n}] int64, got {list(parents.shape)} {parents.dtype}"
        )
    if not matching:
        raise ValueError("draft trees are verified by GREEDY or TARGET_MATCH, not REJECTION")
    if not (isinstance(max_depth, int) and 1 <= max_depth <= n - 1):
        raise ValueError(f"max_depth must be in 1..{n - 1} with parents, got {max_depth!r}")
    return max_depth


def walk_trees(
    cand: torch.Tensor,
    drafts: torch.Tensor,
    parents: torch.Tensor,
    num_draft: torch.Tensor | None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """The walk of every tree (one program per request) into ``out``: accepted lengths [B],
    tokens [B, D+1] and the accepted path [B, D+1]. ``cand`` [B, N]: each node's target
    choice; ``drafts`` [B, N-1]: the nodes' tokens."""
    b, n = parents.shape
    depth = out[1].shape[1] - 1
    has_num = num_draft is not None
    tensors = (cand, drafts, parents, num_draft if has_num else drafts, *out)
    constants = {
        "DEPTH": depth,
        "HAS_NUM_DRAFT": has_num,
        "BLOCK_N": triton.next_power_of_2(n),
        "BLOCK_D": triton.next_power_of_2(depth + 1),
    }
    _WALK((b, 1, 1), tensors, (n,), constants)


def walk_trees_ref(
    cand: torch.Tensor,
    draft: torch.Tensor,
    parents: torch.Tensor,
    num_draft: torch.Tensor,
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From each root, move to the child whose token is the target's choice (``cand`` [B, N])
    after its parent, while there is one; then the last node's choice."""
    b, n = parents.shape
    nodes = torch.arange(n, device=cand.device)
    tok = torch.cat([torch.full_like(draft[:, :1], -1), draft], dim=1)  # [B, N]
    valid = (nodes >= 1) & (nodes <= num_draft[:, None])
    ok = valid & (tok == cand.gather(1, parents.clamp_min(0)))
    out = torch.full((b, depth + 1), -1, dtype=torch.int64, device=cand.device)
    path = out.clone()
    path[:, 0] = 0
    cur = torch.zeros(b, dtype=torch.int64, device=cand.device)
    alive = torch.ones(b, dtype=torch.bool, device=cand.device)
    for step in range(depth):
        child = torch.where(ok & (parents == cur[:, None]), nodes, n).min(dim=1).values
        alive = alive & (child < n)
        out[:, step] = torch.where(alive, tok.gather(1, child.clamp(max=n - 1)[:, None])[:, 0], -1)
        path[:, step + 1] = torch.where(alive, child, -1)
        cur = torch.where(alive, child, cur)
    accept_len = (path[:, 1:] >= 0).sum(dim=1)
    out.scatter_(1, accept_len[:, None], cand.gather(1, cur[:, None]))
    return accept_len, out, path
