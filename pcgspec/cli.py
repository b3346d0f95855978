"""Command line: ``pcgspec generate``, ``serve`` and ``convert`` (SGLang's flag names)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import MISSING, fields

from pcgspec import envs
from pcgspec.config import EngineConfig

# EngineConfig field -> flag, where SGLang's name differs from the field name.
_FLAG_NAMES = {"model": "--model-path", "tokenizer": "--tokenizer-path"}
_TYPES = {"int": int, "float": float, "str": str}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, so the two never drift apart."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = _FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        kind = str(f.type).split(" |")[0]
        default = None if f.default is MISSING else f.default
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action="store_true", default=default)
        elif kind.startswith("tuple"):
            group.add_argument(flag, dest=f.name, type=str, default=default,
                               help="comma-separated integers")
        else:
            group.add_argument(flag, dest=f.name, type=_TYPES[kind], default=default)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    s.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=None)
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("-n", type=int, default=1)
    s.add_argument("--json", action="store_true", help="print JSON with token ids and metrics")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--api-key", default=None,
                   help="Bearer key required on /v1/*, /server_info and /health_generate "
                        "(default: $PCGSPEC_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model folder's name)")
    s.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="larger request bodies get 413")
    s.add_argument("--graceful-shutdown-timeout", type=float, default=5.0,
                   help="seconds SIGTERM lets running requests finish before aborting them")
    s.add_argument("--keep-alive-timeout", type=float, default=30.0,
                   help="seconds an idle connection stays open, before its first request too "
                        "(default: %(default)s)")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive, then 408 "
                        "(default: %(default)s)")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="open connections at most; more get 503 and are closed "
                        "(default: %(default)s)")


def _convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face folder")
    p.add_argument("gguf", help="path of the .gguf file")
    p.add_argument("output", help="folder to write (config.json, model.safetensors, tokenizer)")


def _run_generate(args: argparse.Namespace) -> int:
    from pcgspec.llm import LLM
    from pcgspec.sampling_params import SamplingParams

    prompts = args.prompt or ["Write a haiku about a fast GPU."]
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
        max_tokens=args.max_new_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    llm = LLM(**vars(engine_config_from_args(args)))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": [o.text for o in out.outputs],
                              "token_ids": [o.token_ids for o in out.outputs],
                              "finish_reason": [o.finish_reason for o in out.outputs],
                              "ttft_s": out.metrics.ttft,
                              "tokens_per_s": out.metrics.tokens_per_s}))
        else:
            for o in out.outputs:
                print(f">>> {prompt}\n{o.text}\n[{o.finish_reason}; {len(o.token_ids)} tokens, "
                      f"{out.metrics.tokens_per_s or 0:.1f} tok/s]")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from pcgspec.server.app import run_server
    from pcgspec.server.state import ServerSettings

    settings = ServerSettings(
        host=args.host, port=args.port, api_key=args.api_key or envs.api_key(),
        served_model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        keep_alive_timeout=args.keep_alive_timeout, read_timeout=args.read_timeout,
        max_connections=args.max_connections,
    )
    return run_server(engine_config_from_args(args), settings)


def _run_convert(args: argparse.Namespace) -> int:
    from pcgspec.models.gguf import convert_gguf

    print(convert_gguf(args.gguf, args.output))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pcgspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _convert_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=(getattr(args, "log_level", None) or envs.log_level()).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run = {"generate": _run_generate, "serve": _run_serve, "convert": _run_convert}
        return run[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
