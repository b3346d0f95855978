"""The command line: help and names, and errors instead of tracebacks (busy port, no CUDA,
Ctrl-C, a context above the model's, converting into an existing folder).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pcgspec import __version__
from pcgspec.cli import build_parser, main
from pcgspec.config import EngineConfig
from pcgspec.engine_args import ENGINE_HELP
from pcgspec.models.loader import context_length

REPO = Path(__file__).resolve().parents[1]
SMALL = ("--device", "cpu", "--dtype", "float32", "--disable-piecewise-cuda-graph")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_imports_no_torch():
    code = (
        "import sys\nfrom pcgspec.cli import main\ntry:\n    main(['serve', '--help'])\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert "--max-running-requests" in result.stdout


@pytest.mark.parametrize("command", ["generate", "serve", "convert"])
def test_every_flag_has_help_naming_its_default_and_choices(command):
    parser = _subcommands()[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"
        line = " ".join(parser._get_formatter()._expand_help(action).split())
        if action.default not in (None, False, argparse.SUPPRESS):
            assert "default:" in line, f"{action.option_strings}: {line!r}"
        if action.choices:
            assert "{" + ",".join(action.choices) + "}" in text
    assert set(ENGINE_HELP) == {f.name for f in fields(EngineConfig)}


@pytest.mark.parametrize("command", [None, "generate", "serve", "convert", "train-eagle3"])
def test_help_is_plain_text(command):
    parser = build_parser() if command is None else _subcommands()[command]
    text = parser.format_help()
    for markup in ("``", "::", "`"):
        assert markup not in text, f"{markup!r} in the help of {command or 'pcgspec'}"
    assert parser.description and parser.description in " ".join(text.split())


def test_names_vllm_users_type():
    args = build_parser().parse_args(["generate", "--max-tokens", "7"])
    assert args.max_new_tokens == 7
    args = build_parser().parse_args(["serve", "some/model", "--port", "1"])
    assert args.model_tag == "some/model"
    args = build_parser().parse_args(["serve", "--speculative-algorithm", "ngram"])
    assert args.speculative_algorithm == "NGRAM"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"pcgspec {__version__}"


def test_serve_positional_model_conflicting_with_model_path(capsys):
    assert main(["serve", "a-model", "--model-path", "another"]) == 2
    assert "two models given" in capsys.readouterr().err


def test_busy_port_fails_before_the_model_loads(capsys, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", str(tmp_path / "no-model"), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "meta-llama/Llama-3.2-1B", "--port", "0"],
        ["generate", "--model-path", "Qwen/Qwen2.5-0.5B"],
    ],
)
def test_a_hub_id_says_what_to_pass_instead(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "not available in pcgspec" in err and "config.json" in err and ".gguf" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_an_error(capsys):
    assert main(["generate", "--device", "cuda", "--prompt", "hi"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        EngineConfig(device="gpu")


def test_context_length_above_the_models_maximum(capsys, smollm2_path):
    hf = SimpleNamespace(max_position_embeddings=8192)
    assert context_length(None, hf) == 8192 and context_length(100, hf) == 100
    code = main(
        [
            "generate",
            "--model-path",
            str(smollm2_path),
            *SMALL,
            "--context-length",
            "100000",
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "context_length 100000 exceeds the model's maximum" in err
    assert "max_position_embeddings = 8192" in err


def test_convert_into_an_existing_folder(capsys, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["convert", str(tmp_path / "missing.gguf"), str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.gguf"), str(out), "--force"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert (out / "config.json").read_text() == "{}"  # a failed --force keeps the old folder
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["convert", str(tmp_path / "missing.gguf"), str(other), "--force"]) == 2
    assert "refusing to replace it" in capsys.readouterr().err and (other / "keep.txt").exists()


def _start(args: list[str], **env: str) -> subprocess.Popen[str]:
    # NOTE: a shell without job control starts background jobs with SIGINT ignored, and a
    # Python started so keeps ignoring it: Ctrl-C must reach the CLI wherever the suite runs.
    return subprocess.Popen(
        [sys.executable, "-m", "pcgspec", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PCGSPEC_LOG_LEVEL": "INFO", **env},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _interrupt_after(
    proc: subprocess.Popen[str], marker: str, delay_s: float = 0.0
) -> tuple[str, str]:
    """SIGINT ``delay_s`` after stderr shows ``marker``; returns (stdout, stderr)."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            time.sleep(delay_s)
            proc.send_signal(signal.SIGINT)
            break
    try:
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # NOTE: no process left running after a failed test
            proc.kill()
            proc.communicate()
    return out, "".join(seen) + rest


def test_ctrl_c_in_generate_prints_what_was_generated_and_exits_130(smollm2_path):
    proc = _start(
        [
            "generate",
            "--model-path",
            str(smollm2_path),
            *SMALL,
            "--prompt",
            "Count:",
            "--max-tokens",
            "4000",
            "--ignore-eos",
            "--context-length",
            "4096",
        ]
    )
    # NOTE: the delay lets tokenizing the prompt pass; 4000 tokens take minutes on CPU.
    out, err = _interrupt_after(proc, "Generating for 1 prompt", delay_s=1.0)
    assert proc.returncode == 130, err
    assert out.startswith(">>> Count:\n") and "[abort; " in out, out
    assert "interrupted" in err and "Traceback" not in err, err


def test_ctrl_c_during_serve_start_up_never_announces_serving(smollm2_path):
    port = str(_free_port())
    # NOTE: the piecewise trace keeps the engine starting for seconds after the weights load.
    proc = _start(
        ["serve", str(smollm2_path), "--port", port, "--device", "cpu"], PCGSPEC_CPU_PIECEWISE="1"
    )
    _, err = _interrupt_after(proc, "Loaded LlamaForCausalLM")
    assert proc.returncode == 130, err
    assert "serving" not in err and "Traceback" not in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
