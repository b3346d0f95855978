"""Model drafters under tensor parallelism on CPU (gloo): EAGLE3 and NEXTN heads (borrowing
the target's embedding and LM head, which rank 0 holds whole for them) and a STANDALONE draft
model run on rank 0 while the target is sharded over two ranks, EAGLE3 draft trees too;
greedy tokens equal TP=1 plain decoding.
"""

from __future__ import annotations

import types

import pytest
import torch
from oracle import assert_all_pages_free
from test_models import tiny_hf_model
from test_tree_spec import planted

from pcgspec import LLM, SamplingParams
from pcgspec.models.eagle3 import write_eagle3_checkpoint
from pcgspec.models.loader import load_config, load_model, load_vocab_modules
from pcgspec.models.mtp import write_mtp_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-llama-tp-spec")
    tiny_hf_model("LlamaConfig").save_pretrained(path)  # 4 heads, 2 KV heads, vocab 256
    return path


@pytest.fixture(scope="module")
def engine_kw(smollm2_path) -> dict:
    return dict(
        tokenizer=str(smollm2_path),
        dtype="float32",
        device="cpu",
        page_size=4,
        max_total_tokens=512,
        disable_piecewise_cuda_graph=True,
    )


def prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (3, 17, 9)]
    return [{"prompt_token_ids": p} for p in ids]


PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_tokens(target, engine_kw) -> list[list[int]]:
    llm = LLM(str(target), **engine_kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]


def test_vocab_modules_are_the_targets(target) -> None:
    full = load_model(target, torch.float32, "cpu")
    vocab = load_vocab_modules(target, torch.float32, "cpu")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(
            vocab.get_parameter(name), full.get_parameter(name), rtol=0, atol=0
        )
    assert vocab.model.layers[0].mlp.down_proj.weight.is_meta  # nothing else is allocated
    assert (vocab.vocab_size, vocab.num_layers) == (full.vocab_size, full.num_layers)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE", "NEXTN"])
def test_tp2_model_drafters_greedy_equal_tp1_plain(
    algorithm, target, engine_kw, plain_tokens, tmp_path
) -> None:
    if algorithm == "EAGLE3":
        draft = write_eagle3_checkpoint(tmp_path / "eagle3", load_config(target), seed=1)
    elif algorithm == "NEXTN":
        draft = write_mtp_checkpoint(tmp_path / "mtp", load_config(target), seed=1)
    else:
        small = tiny_hf_model("LlamaConfig")  # the target's first layer only: agrees often
        small.model.layers, small.config.num_hidden_layers = small.model.layers[:1], 1
        draft = tmp_path / "small"
        small.save_pretrained(draft)
    """Lossless (TP=1 plain tokens), and the drafts are TP=1's: every step proposes the tokens
    the TP=1 speculative engine proposes.
    """
    spec = dict(
        speculative_algorithm=algorithm,
        speculative_draft_model_path=str(draft),
        speculative_num_steps=3,
        speculative_policy="always",
    )
    single = LLM(str(target), **spec, **engine_kw)
    want_drafts = recorded_drafts(single)
    single.generate(prompts(), PARAMS, use_tqdm=False)
    llm = LLM(str(target), tp_size=2, **spec, **engine_kw)
    drafts = recorded_drafts(llm)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), PARAMS, use_tqdm=False)]
        assert llm.engine.spec_stats()["verify_steps"] > 0
        assert_all_pages_free(llm)
    finally:
        llm.shutdown()
    assert got == plain_tokens
    assert drafts == want_drafts and len(drafts) > 3


def recorded_drafts(llm: LLM) -> list[list[list[int]]]:
    """The draft tokens of every ``propose`` call the engine makes from now on."""
    proposer = llm.engine.spec_worker.proposer
    propose, seen = proposer.propose, []

    def recorded(batch):
        proposal = propose(batch)
        seen.append(proposal.tokens.tolist())
        return proposal

    proposer.propose = recorded
    return seen


def test_tp2_draft_trees_greedy_equal_tp1_plain(target, engine_kw, plain_tokens, tmp_path) -> None:
    """EAGLE3 trees with the target sharded over two ranks: one branch of every tree planted
    with the target's greedy continuation, so that paths of nodes that are not consecutive are
    accepted and their K/V moved on every rank (a worker that kept them in place would attend
    to the wrong keys and part from plain decoding)."""
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", load_config(target), seed=1)
    spec = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        speculative_policy="always",
    )
    ids = [p["prompt_token_ids"] for p in prompts()]
    want = [types.SimpleNamespace(token_ids=t) for t in plain_tokens]
    llm = LLM(str(target), tp_size=2, **spec, **engine_kw)
    runner, moved = llm.engine.runner, []
    move = runner.move_accepted_kv

    def counted(page_table, start, path):
        steps = torch.arange(path.shape[1])
        moved.append(int((path > steps).sum()))  # nodes not already in place
        move(page_table, start, path)

    runner.move_accepted_kv = counted
    try:
        with planted(llm, ids, want):
            outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert_all_pages_free(llm)
    finally:
        llm.shutdown()
    assert got == plain_tokens
    assert sum(moved) > 0, "no accepted node moved: the test would not see a worker skip it"
