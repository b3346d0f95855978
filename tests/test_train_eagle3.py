"""``pcgspec train-eagle3`` on CPU: the TTT loss falls on a tiny random Llama; packed lines give
the loss of one sequence per line, and the compiled loss the eager one; the whole
pipeline (prompts -> generate + capture -> train -> export) on a tiny counting target gives a
head that ``load_eagle3_head`` reads and that pcgspec's engine accepts drafts from (accept
length above 1, output equal to plain decoding); resume; bad flags; the everyday requests
(varied, none of the benchmark's chat questions); the held-out estimate over the start of
chat-template responses; the default EAGLE3 draft.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_draft_heads import HeadDriver
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.cli import main
from pcgspec.config import EngineConfig
from pcgspec.models import default_model
from pcgspec.models.eagle3 import (
    Eagle3Head,
    default_aux_layers,
    load_eagle3_head,
    write_eagle3_checkpoint,
)
from pcgspec.models.loader import load_config, load_model
from pcgspec.models.random_weights import random_model
from pcgspec.runners.batch_builder import SeqChunk
from pcgspec.training.chat_requests import ARITHMETIC, KINDS, all_requests, sample_requests
from pcgspec.training.data import (
    BatchShape,
    ShardWriter,
    batch_shape,
    chat_flags,
    make_batch,
    plan_batches,
    write_index,
)
from pcgspec.training.loss import Batch, ttt_loss
from pcgspec.training.model import build_trainable_head, unroll
from pcgspec.training.options import TrainOptions
from pcgspec.training.prompts import (
    MIX,
    Prompt,
    build_prompts,
    describe,
    template_prompts,
    topic_pools,
    vocabulary_words,
)
from pcgspec.training.trainer import CHAT_EVAL_TOKENS, Trainer, accept_length_estimate

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TINY_RUN = [
    "--num-prompts",
    "12",
    "--self-prompt-fraction",
    "0.1",
    "--max-tokens",
    "20",
    "--gen-batch-size",
    "8",
    "--eval-fraction",
    "0.2",
    "--draft-vocab-size",
    "64",
    "--ttt-steps",
    "5",
    "--batch-tokens",
    "1024",
    "--lr",
    "3e-3",
    "--eval-every",
    "6",
    "--save-every",
    "6",
    "--log-every",
    "3",
    "--device",
    "cpu",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """NOTE: these tiny models run 10-20x faster on one thread than on two on a loaded machine
    (OpenMP workers wait on each other); restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def counting_target(tmp_path_factory, smollm2_path) -> Path:
    """A tiny Llama (SmolLM2's tokenizer and vocabulary) that counts: its layers add nothing
    (zero ``o_proj`` / ``down_proj``) and ``lm_head`` row ``j`` is the embedding of ``j - 1``,
    so greedy decoding follows token ``x`` with ``x + 1``.
    """
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.2)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(embed.roll(1, dims=0))
    path = tmp_path_factory.mktemp("counting-llama")
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copy(smollm2_path / name, path / name)
    return path


@pytest.fixture(scope="module")
def trained(counting_target, tmp_path_factory) -> tuple[Path, Path]:
    """``(work_dir, out)`` of one tiny run of the whole command."""
    root = tmp_path_factory.mktemp("train-eagle3")
    work, out = root / "work", root / "head"
    code = main(
        [
            "train-eagle3",
            "--model",
            str(counting_target),
            "--work-dir",
            str(work),
            "--out",
            str(out),
            "--epochs",
            "12",
            "--raw-prompt-fraction",
            "0.25",
            *TINY_RUN,
        ]
    )
    assert code == 0
    return work, out


def test_ttt_loss_falls_on_a_tiny_random_llama() -> None:
    """Twenty AdamW steps on one batch of a random 3-layer Llama's own hidden states: the
    weighted TTT loss falls by a fifth and step-0 accuracy rises.
    """
    hf = tiny_hf_model("LlamaConfig").eval()
    target = load_model_from_hf(hf)
    aux_layers = default_aux_layers(target.num_layers)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 48), generator=gen)
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i] for i in aux_layers], dim=-1)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 8:] = True
    batch = Batch(ids, mask, aux, states[-1])
    head = build_trainable_head(target, torch.arange(0, 256, 2), aux_layers, seed=0)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses, first_acc = [], None
    for _ in range(20):
        loss, counts = ttt_loss(head, batch, num_steps=5, decay=0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        acc = (counts.correct / counts.count).tolist()
        first_acc = acc if first_acc is None else first_acc
    assert losses[-1] < 0.8 * losses[0], losses
    assert acc[0] > first_acc[0] + 0.2, (first_acc, acc)
    assert counts.count.tolist() == [2 * 40] * 5  # rows whose predicted token is in 8..47


def _tiny_target_and_head() -> tuple[torch.nn.Module, Eagle3Head]:
    """The tiny random target and a fresh head over every third token of its vocabulary."""
    target = random_model("tiny", torch.float32, "cpu", seed=1)
    head = build_trainable_head(
        target, torch.arange(1, target.vocab_size, 3), default_aux_layers(target.num_layers), seed=0
    )
    return target, head


def test_unrolled_steps_equal_chain_drafting_through_the_kv_cache() -> None:
    """TTT step ``i`` at row ``t`` equals inference: the head catches up over rows ``0..t`` in
    the paged KV cache (tokens ``1..t+1``, the target's aux states), then takes ``i`` one-token
    draft steps on its own ``next_hidden`` with tokens ``t+2..t+1+i`` at positions ``t+1..t+i``.
    Two sequences are packed in one line (then padding): each sees only itself.
    """
    target, head = _tiny_target_and_head()
    head.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, 24), generator=gen)
    aux = torch.randn(1, 24, 3 * target.hidden_size, generator=gen)
    seq = torch.tensor([[0] * 12 + [1] * 9 + [-1] * 3])
    positions = torch.tensor([[*range(12), *range(9), 0, 0, 0]])
    with torch.no_grad():
        steps = list(unroll(head, ids, aux, seq, positions, num_steps=4))  # [1, 23, vocab]
    for start, length, rows in ((0, 12, (0, 4, 9)), (12, 9, (0, 5))):
        own_ids, own_aux = ids[0, start : start + length], aux[0, start : start + length]
        for t in rows:
            driver = HeadDriver(head)
            chunk = SeqChunk(own_ids[1 : t + 2].tolist(), 0, range(4))
            logits_h, next_h = driver.step([chunk], own_aux[: t + 1])
            got, hidden = [head.lm_head(logits_h[t])], next_h[t : t + 1]
            for i in range(1, min(4, length - 1 - t)):
                token = int(own_ids[t + 1 + i])
                logits_h, hidden = driver.step([SeqChunk([token], t + i, range(4))], hidden)
                got.append(head.lm_head(logits_h[0]))
            for i, logits in enumerate(got):
                torch.testing.assert_close(logits, steps[i][0, start + t], atol=1e-4, rtol=1e-4)


def test_packed_lines_give_the_loss_of_one_sequence_per_line() -> None:
    """Sequences packed two to a line (``plan_batches``, ``make_batch``) give the per-step
    loss, correct and counted rows of the same sequences one per line; every sequence lands in
    exactly one line of the planned shape.
    """
    target, head = _tiny_target_and_head()
    head.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    lengths = [30, 17, 25, 12, 9, 28]
    total, hidden = sum(lengths), target.hidden_size
    tensors = {
        "input_ids": torch.randint(
            0, target.vocab_size, (total,), generator=gen, dtype=torch.int32
        ),
        "loss_mask": (torch.rand(total, generator=gen) > 0.3).to(torch.uint8),
        "aux": torch.randn(total, 3 * hidden, generator=gen),
        "final": torch.randn(total, hidden, generator=gen),
        "offsets": torch.tensor([0, *lengths]).cumsum(0),
    }
    shape = batch_shape([{"lengths": lengths}], batch_tokens=200)
    assert shape == BatchShape(lines=3, line_tokens=64)
    plan = plan_batches([{"lengths": lengths}], shape, seed=3)
    assert all(len(lines) == 3 for _, lines in plan)
    placed = [i for _, lines in plan for line in lines for i in line]
    assert sorted(placed) == list(range(6))
    assert all(sum(lengths[i] for i in line) <= 64 for _, lines in plan for line in lines)
    chat = [True] * 6
    with torch.no_grad():
        packed = [
            ttt_loss(head, make_batch(tensors, chat, lines, 64, torch.device("cpu")), 3, 0.8)
            for _, lines in plan
        ]
        alone = ttt_loss(
            head,
            make_batch(tensors, chat, [[i] for i in range(6)], 32, torch.device("cpu")),
            3,
            0.8,
        )
    count = sum(counts.count for _, counts in packed)
    assert count.tolist() == alone[1].count.tolist() and count[0] > 0
    assert sum(counts.correct for _, counts in packed).tolist() == alone[1].correct.tolist()
    loss_sum = sum(counts.loss * counts.count for _, counts in packed)
    torch.testing.assert_close(loss_sum, alone[1].loss * alone[1].count, rtol=1e-4, atol=1e-4)


def test_compiled_loss_equals_eager() -> None:
    """``ttt_loss(compiled=True)`` (torch.compile, as the trainer runs it on CUDA) gives the
    eager loss, counts and gradients on a packed batch.
    """
    target, head = _tiny_target_and_head()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 32), generator=gen)
    aux = torch.randn(2, 32, 3 * target.hidden_size, generator=gen)
    final = torch.randn(2, 32, target.hidden_size, generator=gen)
    seq = torch.tensor([[0] * 20 + [1] * 12, [0] * 28 + [-1] * 4])
    positions = torch.tensor([[*range(20), *range(12)], [*range(28), 0, 0, 0, 0]])
    batch = Batch(ids, seq >= 0, aux, final, seq, positions)
    results = []
    for compiled in (False, True):
        head.zero_grad(set_to_none=True)
        loss, counts = ttt_loss(head, batch, num_steps=2, decay=0.8, compiled=compiled)
        loss.backward()
        results.append(
            (
                loss.detach(),
                counts,
                [p.grad.clone() for p in head.parameters() if p.grad is not None],
            )
        )
    (eager, eager_counts, eager_grads), (fused, fused_counts, fused_grads) = results
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-5)
    assert fused_counts.correct.tolist() == eager_counts.correct.tolist()
    assert fused_counts.count.tolist() == eager_counts.count.tolist()
    for got, want in zip(fused_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def load_model_from_hf(hf: torch.nn.Module) -> torch.nn.Module:
    """pcgspec's Llama with ``hf``'s weights (through a temporary folder)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        return load_model(tmp, torch.float32, "cpu")


def test_raw_prompts_skip_the_chat_template(counting_target) -> None:
    """A prompt with ``chat=False`` goes to the target as its text's ids; the others through
    the chat template (which holds its own special tokens)."""
    from pcgspec.training.generate import generate_responses

    llm = LLM(
        str(counting_target), dtype="float32", device="cpu", disable_piecewise_cuda_graph=True
    )
    tok, text = llm.get_tokenizer(), "Count on: 5 6 7"
    prompts = [Prompt(text, "prose", "builtin", chat=False), Prompt(text, "prose", "builtin")]
    (raw, raw_out), (chat, chat_out) = generate_responses(llm, prompts, 4, 0.0, seed=0)
    assert raw == tok.encode(text)
    templated = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    assert chat == tok.encode(templated, add_special_tokens=False) != raw
    assert raw_out == [raw[-1] + i for i in range(1, 5)]  # the target counts on
    assert chat_out == [chat[-1] + i for i in range(1, 5)]


def test_pipeline_head_is_accepted_by_the_engine(trained, counting_target) -> None:
    work, out = trained
    index = json.loads((work / "data" / "index.json").read_text())
    assert index["metadata"]["prompts"]["without_chat_template"] == 3  # 0.25 of 12
    summary = json.loads((work / "train_summary.json").read_text())
    assert set(summary["times_s"]) >= {"prompts", "generate", "capture", "train"}
    assert summary["data"]["eval"]["sequences"] >= 1
    final = summary["train"]["final_eval"]
    assert final["accuracy"][0] > 0.5 and final["accept_length"] > 2.0, final
    assert final["accept_length_by_k"][-1] == final["accept_length"]
    assert len(final["accept_length_by_k"]) == 5
    chat = final["chat64"]  # the held-out split is chat-template, responses under 64 tokens
    assert chat["rows"] == final["rows"] and len(chat["accept_length_by_k"]) == 5, final
    assert "chat64" not in chat  # not nested
    flags = [chat for shard in index["shards"] for chat in shard["chat"]]
    assert len(flags) == sum(len(shard["lengths"]) for shard in index["shards"])
    assert flags.count(False) == 3  # the raw prompts
    assert (out / "train_summary.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 0, -1]
    target = load_model(counting_target, torch.float32, "cpu")
    head = load_eagle3_head(out, target, torch.float32, "cpu")
    assert head.target_aux_layers(3) == default_aux_layers(3)
    assert head.embed_tokens is None and head.lm_head.weight.shape == (64, 64)

    texts = ("What is a volcano?", "Write a haiku about rain.", "Sort a list in Python.")
    prompts = [[{"role": "user", "content": text}] for text in texts]
    params = SamplingParams(temperature=0, max_tokens=12)
    kw = {"dtype": "float32", "device": "cpu", "disable_piecewise_cuda_graph": True}
    plain = LLM(str(counting_target), **kw).chat(prompts, params, use_tqdm=False)
    spec_llm = LLM(
        str(counting_target),
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(out),
        speculative_num_steps=3,
        speculative_policy="always",
        **kw,
    )
    spec = spec_llm.chat(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.engine.spec_stats()["avg_spec_accept_length"] > 2.0


def test_resume_continues_from_the_last_checkpoint(trained, counting_target) -> None:
    work, out = trained
    steps = json.loads((work / "train_summary.json").read_text())["train"]["steps"]
    assert sorted(p.name for p in (work / "checkpoints").glob("*.pt"))[-1] == f"step-{steps:08d}.pt"
    code = main(
        [
            "train-eagle3",
            "--model",
            str(counting_target),
            "--work-dir",
            str(work),
            "--out",
            str(out),
            "--phases",
            "train",
            "--resume",
            "--epochs",
            "13",
            *TINY_RUN,
        ]
    )
    assert code == 0
    summary = json.loads((work / "train_summary.json").read_text())["train"]
    assert summary["steps"] == summary["total_steps"] == steps // 12 * 13
    assert summary["evals"][0]["step"] == 6  # the evaluations before the resume are kept


def test_max_train_seconds_fits_the_schedule(trained, counting_target, tmp_path) -> None:
    """With a time limit the cosine schedule is fitted to the measured step time: far fewer
    steps than 100,000 epochs plan, and training stops in time.
    """
    work, _ = trained
    shutil.copytree(work / "data", tmp_path / "data")
    code = main(
        [
            "train-eagle3",
            "--model",
            str(counting_target),
            "--work-dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "head"),
            "--phases",
            "train",
            "--epochs",
            "100000",  # NOTE: more steps than any machine runs in 2 s
            "--max-train-seconds",
            "2",
            *TINY_RUN,
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    train = summary["train"]
    assert train["steps"] <= train["total_steps"] < train["planned_steps"] == 100000
    assert summary["times_s"]["train"] < 8


def test_a_wider_head_is_trained_exported_and_loaded(trained, counting_target, tmp_path) -> None:
    work, _ = trained
    shutil.copytree(work / "data", tmp_path / "data")
    out = tmp_path / "head"
    code = main(
        [
            "train-eagle3",
            "--model",
            str(counting_target),
            "--work-dir",
            str(tmp_path),
            "--out",
            str(out),
            "--phases",
            "train",
            "--head-intermediate-size",
            "96",
            "--max-steps",
            "2",
            *TINY_RUN,
        ]
    )
    assert code == 0
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 96  # target: 128
    target = load_model(counting_target, torch.float32, "cpu")
    head = load_eagle3_head(out, target, torch.float32, "cpu")
    assert head.midlayer.mlp.down_proj.weight.shape == (64, 96)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--out", "o", "--num-prompts", "0"], "--num-prompts must be an integer >= 1"),
        (["--phases", "train"], "--out is required by the train phase"),
        (["--phases", "prompts,fly"], "--phases must be a comma-separated subset"),
        (["--out", "o", "--ttt-steps", "0"], "--ttt-steps must be an integer >= 1"),
        (
            ["--out", "o", "--head-intermediate-size", "0"],
            "--head-intermediate-size must be an integer >= 1",
        ),
        (
            ["--out", "o", "--eval-fraction", "0.9"],
            r"--eval-fraction must be a number in \[0, 0.5\]",
        ),
        (["--out", "o", "--lr", "0"], "--lr must be a number"),
        (["--out", "o", "--device", "tpu"], "device must be auto, cpu, cuda"),
    ],
)
def test_bad_flags_get_clear_errors(tmp_path, capsys, flags, message) -> None:
    code = main(["train-eagle3", "--work-dir", str(tmp_path / "w"), *flags])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


def test_flag_type_errors_and_options_api(tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train-eagle3", "--work-dir", str(tmp_path), "--epochs", "two"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="--max-steps must be an integer >= 1"):
        TrainOptions(work_dir=str(tmp_path), out="o", max_steps=0)
    assert TrainOptions(work_dir="w", phases="prompts, generate").phases == ("prompts", "generate")


def test_prompt_set_mixes_categories_and_records_sources() -> None:
    prompts = template_prompts(400, seed=0)
    info = describe(prompts)
    assert info["num_prompts"] == 400 and info["sources"] == {"builtin": 400}
    assert set(info["categories"]) == set(MIX)
    assert len({p.text for p in prompts}) > 350
    assert template_prompts(400, seed=0) == prompts != template_prompts(400, seed=1)
    raw = build_prompts(400, 0.0, seed=0, llm_factory=None, raw_fraction=0.25)
    assert describe(raw)["without_chat_template"] == 100
    assert sorted(p.text for p in raw) == sorted(p.text for p in prompts)


def test_everyday_requests_are_varied_and_deterministic() -> None:
    """Tens of thousands of distinct requests; a sample of 3000 uses nearly every template of
    every kind (arithmetic word problems too); the same seed gives the same requests.
    """
    assert len(set(all_requests())) > 25_000
    texts = sample_requests(random.Random(0), 3000)
    assert len(set(texts)) == 3000
    assert sample_requests(random.Random(0), 3000) == texts
    assert sample_requests(random.Random(1), 3000) != texts
    patterns = {
        (kind, template): re.compile(re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(template)))
        for kind, templates in KINDS.items()
        for template in templates
    }
    used = {key for key, pattern in patterns.items() for t in texts if pattern.fullmatch(t)}
    assert len(used) > 0.9 * len(patterns)
    assert {kind for kind, _ in used} == set(KINDS)
    matched = {t for t in texts for p in patterns.values() if p.fullmatch(t)}
    assert 100 < len(set(texts) - matched) < 400  # ARITHMETIC: about 1 in 15
    prompts = template_prompts(1000, seed=0)
    assert describe(prompts)["categories"]["request"] == 1000 * MIX["request"]
    assert max(MIX, key=MIX.get) == "request" and ARITHMETIC not in KINDS


def test_no_prompt_is_a_benchmark_chat_question() -> None:
    """scripts/bench_spec.py's chat questions stay unseen: no built-in prompt equals or
    contains one, no everyday request names one of their subjects, and no built-in prompt names
    their most specific ones.
    """
    spec = importlib.util.spec_from_file_location("bench_spec", SCRIPTS / "bench_spec.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_spec"] = bench  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(bench)
    questions = [q.lower().rstrip("?.!") for q in bench.PROMPT_SETS["chat"]]
    assert len(questions) == 16
    requests = list(all_requests())
    texts = [t.lower() for pool in topic_pools().values() for t in pool]
    texts += [t.lower() for t in requests + sample_requests(random.Random(0), 5000)]
    texts += [p.text.lower() for p in template_prompts(5000, seed=0)]
    assert not [(q, t) for t in texts for q in questions if q in t]
    subjects = re.compile(
        r"\b(basil|purrs?|job interviews?|climate|lighthouse|refrigerator|"
        r"bakery|api|hike|cinderella|palindromes?|salty|remembering names|"
        r"solar system|planets?|sunsets?|trains?)\b"
    )
    assert not [t for t in requests if subjects.search(t.lower())]
    # the benchmark's most specific subjects appear in no built-in prompt at all
    specific = re.compile(
        r"\b(basil|purrs?|job interviews?|lighthouse|bakery|cinderella|"
        r"palindromes?)\b"
    )
    assert not [t for t in texts if specific.search(t)]


def test_chat_window_counts_the_start_of_chat_responses() -> None:
    """``Batch.chat_window`` keeps the loss mask on the first ``tokens`` response tokens of
    each chat-template sequence, also of one packed after another in a line: its TTT counts
    equal those of the batch with every other token masked out.
    """
    target, head = _tiny_target_and_head()
    head.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 90), generator=gen)
    aux = torch.randn(2, 90, 3 * target.hidden_size, generator=gen)
    final = torch.randn(2, 90, target.hidden_size, generator=gen)
    seq = torch.tensor([[0] * 90, [0] * 40 + [1] * 40 + [-1] * 10])
    positions = torch.tensor([[*range(90)], [*range(40), *range(40), *[0] * 10]])
    chat = torch.tensor([[True] * 90, [False] * 40 + [True] * 50])
    mask = torch.zeros(2, 90, dtype=torch.bool)
    mask[0, 10:] = True  # 80 response tokens: 64 kept
    mask[1, 5:40] = True  # not a chat sequence (a raw prompt)
    mask[1, 46:80] = True  # 34 response tokens: 30 kept with tokens=30
    batch = Batch(ids, mask, aux, final, seq, positions, chat)
    window = batch.chat_window(64)
    assert window.input_ids.shape == (2, 90)
    assert window.loss_mask.sum(dim=1).tolist() == [64, 34]
    assert batch.chat_window(30).loss_mask.sum(dim=1).tolist() == [30, 30]
    masked = mask.clone()
    masked[0, 10 + 64 :] = False
    masked[1, :40] = False
    with torch.no_grad():
        _, got = ttt_loss(head, window, num_steps=3, decay=0.8)
        _, want = ttt_loss(head, replace(batch, loss_mask=masked), num_steps=3, decay=0.8)
    assert got.count.tolist() == want.count.tolist()
    assert got.correct.tolist() == want.correct.tolist()
    torch.testing.assert_close(got.loss, want.loss)
    assert Batch(ids, mask, aux, final).chat_window(64).loss_mask.sum() == 0


def test_evaluation_reports_the_chat_window(tmp_path) -> None:
    """The held-out evaluation reports ``chat64`` beside the whole split: over the chat-template
    sequences only, their first ``CHAT_EVAL_TOKENS`` response tokens.
    """
    target, head = _tiny_target_and_head()
    gen = torch.Generator().manual_seed(0)
    shards = []
    for split, sequences in (
        ("train", [(8, 20, True)]),
        ("eval", [(8, 100, True), (6, 40, False), (12, 30, True)]),
    ):
        writer = ShardWriter(tmp_path, split, shard_tokens=1 << 20)
        for prompt, response, chat in sequences:
            n = prompt + response
            writer.add(
                torch.randint(0, target.vocab_size, (n,), generator=gen).tolist(),
                [False] * prompt + [True] * response,
                torch.randn(n, 3 * target.hidden_size, generator=gen),
                torch.randn(n, target.hidden_size, generator=gen),
                chat,
            )
        writer.flush()
        shards += writer.shards
    write_index(tmp_path, shards, {"prompts": {}})
    index = json.loads((tmp_path / "index.json").read_text())
    opts = TrainOptions(
        work_dir=str(tmp_path), out="o", device="cpu", ttt_steps=2, batch_tokens=4096
    )
    result = Trainer(head, opts, tmp_path, index, tmp_path / "ckpt").evaluate()
    assert result.rows == 100 + 40 + 30
    assert result.chat64.rows == CHAT_EVAL_TOKENS + 30
    assert len(result.chat64.accept_length_by_k) == 2
    assert f"first {CHAT_EVAL_TOKENS} tokens: {result.chat64.accept_length:.2f}" in result.message()
    old = {"metadata": {"prompts": {"without_chat_template": 0}}}  # written before the flags
    assert chat_flags(old, {"lengths": [5, 7]}) == [True, True]


def test_vocabulary_words_are_whole_lowercase_words(smollm2_path) -> None:
    from transformers import AutoTokenizer

    words = vocabulary_words(AutoTokenizer.from_pretrained(smollm2_path))
    assert len(words) > 10_000 and {"school", "flowers", "geology"} <= set(words)
    assert all(w.isalpha() and w.islower() and len(w) >= 5 for w in words)


def test_accept_length_estimate_is_a_chain() -> None:
    assert accept_length_estimate([1.0, 1.0, 1.0]) == 4.0
    assert accept_length_estimate([0.5, 0.5]) == pytest.approx(1.75)
    assert accept_length_estimate([0.0, 1.0]) == 1.0


def test_eagle3_default_draft_is_the_shipped_head(tmp_path, monkeypatch, smollm2_path) -> None:
    with pytest.raises(ValueError, match="EAGLE3 needs speculative_draft_model_path for target"):
        EngineConfig(model=str(tmp_path), speculative_algorithm="EAGLE3")
    missing = tmp_path / "no-head"
    monkeypatch.setattr(default_model, "DEFAULT_EAGLE3_HEAD", missing)
    with pytest.raises(ValueError, match="EAGLE3 head of SmolLM2-135M-Instruct is missing"):
        EngineConfig(speculative_algorithm="EAGLE3")
    head = write_eagle3_checkpoint(tmp_path / "head", load_config(smollm2_path), 0, 1024)
    monkeypatch.setattr(default_model, "DEFAULT_EAGLE3_HEAD", head)
    for model in (None, str(smollm2_path)):
        spec = EngineConfig(model=model, speculative_algorithm="EAGLE3").speculative_config
        assert spec.draft_model_path(model) == str(head)
    given = EngineConfig(
        model=str(tmp_path), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head)
    )
    assert given.speculative_config.draft_model_path(str(tmp_path)) == str(head)


def test_shipped_head_drafts_for_the_default_model_and_output_equals_plain(
    smollm2_path, plain_llm
) -> None:
    """The head in the package: small, in the published layout, the default EAGLE3 draft of the
    default model; greedy output with it equals plain decoding (lossless whatever the head), and
    it is trained: chat answers accept more than one token a step on average. The speculative
    engine prefills eagerly (the piecewise trace is no part of what the head is tested for).
    """
    head = default_model.DEFAULT_EAGLE3_HEAD
    assert sum(f.stat().st_size for f in head.iterdir()) < 25 * 2**20
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] < config["vocab_size"]
    spec = LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        speculative_algorithm="EAGLE3",
        speculative_num_steps=4,
        speculative_policy="always",
        disable_piecewise_cuda_graph=True,
    )
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a prime number is.",
    ]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = plain_llm.chat(chats, params, use_tqdm=False)
    got = spec.chat(chats, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.spec_stats()["avg_spec_accept_length"] > 1.5
