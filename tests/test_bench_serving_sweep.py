"""bench_serving.py's closed-loop sweep: its datasets, its window arithmetic, its option checks,
and one ``--compare`` run of two configurations, each its own CPU server (about 45 s here)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from script_modules import SCRIPTS, script_module
from server_process import MODEL, bench_launch_flags


@pytest.fixture(scope="module")
def bench():
    """The script as a module; it puts its folder on sys.path for its siblings (imported
    below by name)."""
    with script_module("bench_serving") as module:
        yield module


def test_datasets_are_large_distinct_and_chat_sized(bench):
    from serving_datasets import CHAT, CODE, DATASETS, REPETITION, load

    assert len(CHAT) >= 64 and len(REPETITION) >= 32 and len(CODE) >= 32
    everything = [m for messages in DATASETS.values() for m in messages]
    assert len(set(everything)) == len(everything)
    assert all(5 <= len(m.split()) <= 60 for m in CHAT)
    assert all(":" in m and len(m) > 120 for m in REPETITION)  # each carries its text or code
    assert load("repetition") == list(REPETITION)
    assert load("code") == list(CODE)
    requests = [m.split("\n")[0] for m in CODE]  # a snippet follows on its own lines
    assert len(set(requests)) == len(requests)
    assert all(5 <= len(r.split()) <= 60 for r in requests)
    assert sum("\n" in m for m in CODE) >= 8  # fix or explain a given snippet
    with pytest.raises(ValueError, match="dataset: unknown 'poems'; known: chat, repetition, code"):
        load("poems")


def _template_pattern(template: str, slots: dict) -> re.Pattern:
    """``template`` with each slot field as the alternatives its values fill in."""
    from string import Formatter

    out = ""
    for literal, field, _, _ in Formatter().parse(template):
        out += re.escape(literal)
        if field:
            name = re.split(r"[\[.]", field)[0]
            fills = {("{" + field + "}").format(**{name: v}) for v in slots[name]}
            out += "(?:" + "|".join(map(re.escape, sorted(fills))) + ")"
    return re.compile(out)


def test_chat_is_not_in_the_eagle3_trainers_requests(bench):
    """No chat message is one the EAGLE3 trainer's everyday-request templates can write: the
    shipped head is measured on requests it was not trained on."""
    from serving_datasets import CHAT

    from pcgspec.training.chat_requests import KINDS, SLOTS

    patterns = [_template_pattern(t, SLOTS) for ts in KINDS.values() for t in ts]
    assert patterns[0].fullmatch("How do I unclog a bathroom sink?")  # the check can fail
    assert [m for m in CHAT if any(p.fullmatch(m) for p in patterns)] == []


def test_window_arithmetic(bench):
    from serving_compare import add_ratios, first_difference
    from serving_sweep import Stream, server_window, tokens_in_window

    stream = Stream(0, 0.0, chunks=[(0.5, 2), (1.5, 4), (2.5, 2)], output_tokens=8)
    assert tokens_in_window(stream, (1.0, 3.0)) == 6.0  # 6 of its 8 characters arrived inside
    assert tokens_in_window(stream, (0.0, 3.0)) == 8.0
    assert tokens_in_window(Stream(0, 0.0, error="HTTP 503"), (0.0, 3.0)) == 0.0
    before = {
        "time": 1.0,
        "verify_steps": 10,
        "accepted_draft_tokens": 5,
        "speculative_steps": 4,
        "policy_plain_steps": 2,
        "generation_tokens": 100.0,
        "accepted_per_position": [4, 1],
    }
    after = {
        "time": 3.0,
        "verify_steps": 30,
        "accepted_draft_tokens": 35,
        "speculative_steps": 10,
        "policy_plain_steps": 4,
        "generation_tokens": 180.0,
        "accepted_per_position": [20, 10, 2],
        "steps_speculative": 10,
        "step_s_speculative": 1.0,
        "step_s_prefill": 0.5,
    }
    window = server_window(before, after)
    assert window["step_time_share"] == {"speculative": 0.5, "prefill": 0.25}
    assert window["outside_steps_share"] == 0.25
    assert window["accept_length"] == (30 + 20) / 20 and window["output_tok_s"] == 40.0
    assert window["plain_step_share"] == 2 / 8
    assert window["accept_rate_per_position"] == [16 / 20, 9 / 20, 2 / 20]
    plain = server_window({"time": 0.0, "num_steps": 3}, {"time": 1.0, "num_steps": 9})
    assert plain["accept_length"] is None and plain["plain_step_share"] is None
    assert first_difference("abcd", "abxd") == 2 and first_difference("ab", "abc") == 2
    assert first_difference("same", "same") is None
    points = [
        {
            "config": c,
            "dataset": "chat",
            "temperature": 0.0,
            "concurrency": n,
            "output_tok_s": tok_s,
        }
        for c, n, tok_s in (("a", 1, 10.0), ("b", 1, 15.0), ("b", 4, 40.0))
    ]
    add_ratios(points, "a")
    assert [p["tok_s_ratio"] for p in points] == [1.0, 1.5, None]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--compare", "plain="], "--compare needs --launch"),
        (["--launch", "--compare", "plain"], "--compare: expected NAME=ARGS"),
        (["--launch", "--compare", "a=", "a=--x"], "configuration names repeat"),
        (["--datasets", "poems"], "--datasets: unknown 'poems'"),
        (["--datasets", "chat:speed=2"], "unknown key 'speed'"),
        (["--launch", "--compare", "a=", "--datasets", "chat:configs=b"], "must be among"),
        (["--concurrencies", "1,0"], "--concurrencies: expected positive"),
        (["--datasets", "chat:temperatures=x"], "temperatures: expected comma-separated floats"),
        (["--duration", "0"], "--duration must be > 0"),
        (["--rounds", "0"], "--rounds must be >= 1"),
    ],
)
def test_sweep_options_are_checked(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_sweep_defaults(bench):
    args = bench.parse_args(["--text-check", "4"])
    assert args.sweep and [c.name for c in args.configs] == ["server"]
    assert [(p.dataset, p.concurrencies, p.temperatures) for p in args.plans] == [
        ("chat", (1, 4, 16, 64), (0.0, 0.7))
    ]
    assert (args.max_tokens, args.ignore_eos, args.duration, args.warmup_seconds) == (
        128,
        False,
        30.0,
        5.0,
    )
    single = bench.parse_args([])
    assert not single.sweep and (single.max_tokens, single.ignore_eos) == (32, True)


def test_rounds_take_turns_and_ratios_stay_within_a_round(bench, tmp_path, capsys, monkeypatch):
    """With --rounds the configurations take turns (a, b, a, b), each turn its own server; a
    ratio is against the first configuration of its own round, the text check runs in the
    first round only, and the summary gives the median ratio over the rounds with its range."""
    import serving_compare

    rates = {("a", 0): 100.0, ("b", 0): 150.0, ("a", 1): 80.0, ("b", 1): 80.0}
    launched, checked = [], []

    async def fake_run(args, config, plans, clock, save, round_=0):
        checked.append((config.name, round_, bool(args.text_check and round_ == 0)))
        row = {"output_tok_s": rates[(config.name, round_)], "server": {}}
        point = {"config": config.name, "dataset": "chat", "temperature": 0.0}
        points = [{**point, "concurrency": 1, "round": round_, **row}]
        texts = {"chat": [config.name]} if round_ == 0 else {}
        save(points, texts)
        return points, texts, {"model": "m"}

    monkeypatch.setattr(serving_compare, "_config_run", fake_run)
    monkeypatch.setattr(serving_compare, "_stop", lambda server: None)
    monkeypatch.setattr(serving_compare, "print_table", lambda points, text_check: None)
    args = bench.parse_args(
        ["--launch", "--compare", "a=", "b=--x", "--rounds", "2", "--concurrencies", "1"]
    )
    args.out = str(tmp_path / "sweep.json")
    record = serving_compare.sweep(args, lambda a, extra: launched.append(extra) or object())
    assert launched == [[], ["--x"], [], ["--x"]]
    assert checked == [("a", 0, True), ("b", 0, True), ("a", 1, False), ("b", 1, False)]
    assert [(c["name"], c["round"]) for c in record["configs"]] == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
    ]
    assert [p["tok_s_ratio"] for p in record["points"]] == [1.0, 1.5, 1.0, 1.0]
    b = next(s for s in record["summary"] if s["config"] == "b")
    assert (b["rounds"], b["tok_s"], b["ratio_min"], b["ratio_max"]) == (2, [150.0, 80.0], 1.0, 1.5)
    assert b["ratio_median"] == pytest.approx(1.25)
    assert record["rounds"] == 2 and record["text_check"]["chat"]["b"]["texts"] == ["b"]
    partial = json.loads(Path(f"{args.out}.partial").read_text())
    assert partial["text_check"] == {"a": {"chat": ["a"]}, "b": {"chat": ["b"]}}
    assert "Over the rounds" in capsys.readouterr().out

    plot = importlib.util.spec_from_file_location("plot_serving", SCRIPTS / "plot_serving.py")
    module = importlib.util.module_from_spec(plot)
    plot.loader.exec_module(module)
    assert module.ratio_lines(record) == {"b chat T=0": [(1, pytest.approx(1.25))]}


def test_compare_two_servers(bench, tmp_path, capsys, monkeypatch):
    """plain and NGRAM, each its own CPU server: chat at concurrency 2 (greedy), and repetition
    sampled at concurrency 1 on NGRAM only; the JSON, its ratios and the plot. One chat point
    per configuration gives a served ratio; test_window_arithmetic pairs the points of several
    concurrencies."""
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")  # NOTE: starts the servers sooner
    out = tmp_path / "sweep.json"
    record = bench.main(
        [
            *bench_launch_flags(tmp_path),
            "--compare",
            "plain=",
            "ngram=--speculative-algorithm NGRAM --speculative-num-steps 4 "
            "--speculative-policy always",
            "--datasets",
            "chat:concurrencies=2:temperatures=0",
            "repetition:concurrencies=1:temperatures=0.7:configs=ngram",
            "--duration",
            # NOTE: whole requests inside the window even on a loaded 2-core machine (seen:
            # 0.5 s a token with the other test worker busy)
            "6",
            "--warmup-seconds",
            "0.5",
            "--text-check",
            "2",
            "--max-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["points"] == json.loads(json.dumps(record["points"]))
    partial = json.loads(Path(f"{out}.partial").read_text())  # what a run cut short keeps
    assert [p["output_tok_s"] for p in partial["points"]] == [
        p["output_tok_s"] for p in written["points"]
    ]
    for key in (
        "date",
        "device",
        "torch",
        "command",
        "configs",
        "datasets",
        "points",
        "text_check",
        "elapsed_s",
    ):
        assert key in written, key
    assert written["device"] == "cpu" and "--compare plain=" in written["command"]
    plain, ngram = written["configs"]
    assert (plain["name"], ngram["name"], plain["model"]) == ("plain", "ngram", MODEL)
    assert ngram["server_args"][-6:] == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "4",
        "--speculative-policy",
        "always",
    ]
    assert ngram["engine_config"]["speculative_algorithm"] == "NGRAM" and plain["start_s"] > 0
    assert written["datasets"]["chat"]["requests"] >= 64
    points = {(p["config"], p["dataset"], p["concurrency"]): p for p in written["points"]}
    assert sorted(points) == [
        ("ngram", "chat", 2),
        ("ngram", "repetition", 1),
        ("plain", "chat", 2),
    ]
    for key, p in points.items():
        assert p["output_tokens"] > 0 and p["requests_completed"] > 0, key
        assert p["requests_failed"] == 0 and 1 <= p["output_len"]["max"] <= 4, key
        assert p["tpot"]["p50_ms"] > 0 and p["ttft"]["p50_ms"] > 0, key
        assert 0 < p["client_cpu_busy"] < 1.5, key
        server = p["server"]
        # the client counts chunks by arrival, the server tokens by delivery: the window's
        # edges split at most the requests in flight differently
        assert abs(server["counters"]["generation_tokens"] - p["output_tokens"]) <= (
            p["concurrency"] * 4
        )
        if key[0] == "plain":
            assert p["tok_s_ratio"] == 1.0 and server["accept_length"] is None
        else:
            assert server["accept_length"] >= 1.0 and server["plain_step_share"] == 0.0
            assert server["counters"]["verify_steps"] > 0
    ratio = (
        points[("ngram", "chat", 2)]["output_tok_s"] / points[("plain", "chat", 2)]["output_tok_s"]
    )
    assert points[("ngram", "chat", 2)]["tok_s_ratio"] == pytest.approx(ratio)
    assert points[("ngram", "repetition", 1)]["tok_s_ratio"] is None  # plain did not run it
    chat = written["text_check"]["chat"]
    assert chat["plain"]["differ"] == 0 and chat["ngram"]["requests"] == 2
    assert all(chat["plain"]["texts"]) and 0 <= chat["ngram"]["differ"] <= 2
    assert written["text_check"]["repetition"]["ngram"]["differ"] is None
    table = capsys.readouterr().out
    assert "Served speculative decoding" in table and "repetition" in table

    plot = importlib.util.spec_from_file_location("plot_serving", SCRIPTS / "plot_serving.py")
    module = importlib.util.module_from_spec(plot)
    plot.loader.exec_module(module)
    assert sorted(module.ratio_lines(written)) == ["ngram chat T=0"]
    assert module.main([str(out)]) == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert out.with_suffix(".png").stat().st_size > 0


def test_a_run_cut_short_keeps_every_finished_point(bench, tmp_path):
    """The partial file holds the finished configurations and the running one's points so far."""
    from serving_compare import _save_partial

    out = tmp_path / "sweep.json"
    results = {"points": [{"config": "plain", "concurrency": 1}], "text_check": {"plain": {}}}
    configs = [{"name": "plain"}]
    _save_partial(str(out), results, configs, "ngram", [{"config": "ngram"}], {"chat": ["a"]})
    partial = json.loads(Path(f"{out}.partial").read_text())
    assert [p["config"] for p in partial["points"]] == ["plain", "ngram"]
    assert partial["text_check"] == {"plain": {}, "ngram": {"chat": ["a"]}}
    assert partial["configs"] == configs and len(results["points"]) == 1
