"""``scripts/measure_accept.py``: a model drafting for itself accepts every draft, and its
speculative output equals its plain output."""

from __future__ import annotations

import json

from script_modules import load_script


def _script():
    return load_script("measure_accept")


def test_first_difference_and_per_position():
    script = _script()
    assert script.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert script.first_difference([1, 2, 3], [1, 5, 3])["position"] == 1
    shorter = script.first_difference([1, 2], [1, 2, 3])
    assert shorter["position"] == 2 and shorter["speculative_token"] is None
    rates = script.per_position([8, 6, 3], steps=10)
    assert rates == {"per_step": [0.8, 0.6, 0.3], "given_previous": [0.8, 0.75, 0.5]}


def test_a_model_drafting_for_itself_accepts_every_draft(tmp_path, smollm2_path, monkeypatch):
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")
    out = tmp_path / "accept.json"
    args = ["--target", str(smollm2_path), "--draft", str(smollm2_path), "--dtype", "float32"]
    args += ["--datasets", "code,chat", "--num-requests", "2", "--lossless-requests", "1"]
    args += ["--max-tokens", "9", "--k", "3", "--cpu-threads", "1", "--out", str(out)]
    script = _script()
    result = script.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    for key in ("date", "device", "torch", "dtype", "command", "k", "max_tokens"):
        assert key in result, key
    for dataset in ("code", "chat"):
        run = result["datasets"][dataset]
        assert run["requests"] == 2 and run["output_tokens"] == 2 * 9
        assert run["accept_length"] == 4.0  # k drafts + 1 bonus on every step
        assert run["acceptance_per_position"]["per_step"] == [1.0, 1.0, 1.0]
    assert result["lossless"] == {
        "requests": 2,
        "equal": 2,
        "tokens_compared": 18,
        "differences": [],
    }

    # --explain: the greedy token at position 3 of the first code request against another
    first = result["datasets"]["code"]["token_ids"][0]
    difference = {"position": 3, "speculative_token": first[3], "plain_token": first[3] + 1}
    result["lossless"]["differences"] = [
        {"dataset": "code", "request": 0, "difference": difference}
    ]
    out.write_text(json.dumps(result))
    args = ["--target", str(smollm2_path), "--dtype", "float32", "--cpu-threads", "1"]
    explained = script.main([*args, "--explain", str(out)])
    logprobs = explained["lossless"]["differences"][0]["logprobs"]
    assert list(logprobs) == ["float32"]
    greedy, other = (logprobs["float32"][str(t)] for t in (first[3], first[3] + 1))
    assert greedy is not None and (other is None or greedy > other)
    assert json.loads(out.read_text()) == explained
