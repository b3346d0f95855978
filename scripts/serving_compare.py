"""``bench_serving.py``'s sweep over configurations: per configuration (with ``--launch`` its
own server) the greedy text check and every load point of every dataset; then the ratios
against the first configuration, the table and the JSON record.

With ``--rounds N`` the configurations take turns N times (a, b, a, b, ...), each turn its own
server: two servers of one configuration on one machine have served 20-30% apart, so a ratio
from one pair of servers can be an artefact of the pair. Each point's ratio is against the first
configuration in its own round, and the summary gives each point's median ratio over the rounds
with its least and greatest; the greedy text check runs in the first round only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import shlex
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from serving_datasets import DATASETS, load
from serving_sweep import Load, open_session, run_point, text_check

NAME = re.compile(r"[A-Za-z0-9_.+-]+")
PLAN_KEYS = ("concurrencies", "temperatures", "configs")


@dataclass(frozen=True)
class Config:
    name: str
    args: str  # flags added to --server-args for this configuration's server


@dataclass(frozen=True)
class Plan:
    """A dataset's load points and the configurations that run them."""

    dataset: str
    concurrencies: tuple[int, ...]
    temperatures: tuple[float, ...]
    configs: tuple[str, ...]


def parse_configs(values: list[str] | None) -> list[Config]:
    """``NAME=ARGS`` each (ARGS may be empty); without ``--compare`` one configuration,
    ``server``, as launched or as found."""
    if not values:
        return [Config("server", "")]
    configs = []
    for value in values:
        name, eq, flags = value.partition("=")
        if not eq or not NAME.fullmatch(name):
            raise ValueError(
                f"--compare: expected NAME=ARGS with NAME of letters, digits and "
                f"_.+-, got {value!r}"
            )
        try:
            shlex.split(flags)
        except ValueError as e:
            raise ValueError(f"--compare: {value!r}: {e}") from None
        configs.append(Config(name, flags))
    names = [c.name for c in configs]
    if len(set(names)) < len(names):
        raise ValueError(f"--compare: configuration names repeat: {names}")
    return configs


def parse_list(text: str, kind: type, field: str) -> tuple[Any, ...]:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"{field}: expected comma-separated {kind.__name__}s, got {text!r}"
        ) from None
    if not values or any(v < (1 if kind is int else 0) for v in values):
        raise ValueError(
            f"{field}: expected {'positive' if kind is int else 'non-negative'} "
            f"values, got {text!r}"
        )
    return values


def parse_plans(
    specs: list[str], concurrencies: str, temperatures: str, configs: list[Config]
) -> list[Plan]:
    """``NAME[:concurrencies=1,4][:temperatures=0][:configs=a,b]`` each; what a spec leaves
    out comes from ``--concurrencies``, ``--temperatures`` and every configuration."""
    names = tuple(c.name for c in configs)
    plans = []
    for spec in specs:
        dataset, *parts = spec.split(":")
        if dataset not in DATASETS:
            raise ValueError(f"--datasets: unknown {dataset!r}; known: {', '.join(DATASETS)}")
        given = {
            "concurrencies": concurrencies,
            "temperatures": temperatures,
            "configs": ",".join(names),
        }
        field = {"concurrencies": "--concurrencies", "temperatures": "--temperatures"}
        for part in parts:
            key, _, value = part.partition("=")
            if key not in PLAN_KEYS:
                raise ValueError(
                    f"--datasets: unknown key {key!r} in {spec!r}; known: {', '.join(PLAN_KEYS)}"
                )
            given[key], field[key] = value, f"--datasets {spec!r}: {key}"
        chosen = tuple(n for n in given["configs"].split(",") if n)
        if not chosen or not set(chosen) <= set(names):
            raise ValueError(f"--datasets: configs of {spec!r} must be among {names}")
        plans.append(
            Plan(
                dataset,
                parse_list(given["concurrencies"], int, field["concurrencies"]),
                parse_list(given["temperatures"], float, field["temperatures"]),
                tuple(n for n in names if n in chosen),
            )
        )
    if len({p.dataset for p in plans}) < len(plans):
        raise ValueError(f"--datasets: a dataset repeats: {specs}")
    return plans


class Clock:
    """Seconds since the sweep began, printed before each phase."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)


def _stop(server: subprocess.Popen | None) -> None:
    if server is not None:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


async def _config_run(
    args: argparse.Namespace,
    config: Config,
    plans: list[Plan],
    clock: Clock,
    save: Callable[[list[dict[str, Any]], dict[str, list[str]]], None],
    round_: int = 0,
) -> tuple[list[dict[str, Any]], dict[str, list[str]], dict[str, Any]]:
    """One configuration's points (of round ``round_``) and greedy texts (in round 0) against
    the server at ``--base-url``, handed to ``save`` after each."""
    points: list[dict[str, Any]] = []
    texts: dict[str, list[str]] = {}
    async with open_session(args.api_key) as session:
        info = await _server_info(session, args.base_url)
        model = args.model or await _first_model(session, args.base_url)
        for plan in (p for p in plans if config.name in p.configs):
            work = Load(
                args.base_url,
                model,
                load(plan.dataset),
                args.max_tokens,
                args.seed,
                args.ignore_eos,
            )
            if args.text_check and round_ == 0:
                texts[plan.dataset] = await text_check(session, work, args.text_check)
                save(points, texts)
                clock.log(
                    f"{config.name}: {plan.dataset} text check of "
                    f"{len(texts[plan.dataset])} requests"
                )
            for temperature in plan.temperatures:
                for concurrency in plan.concurrencies:
                    row = await run_point(
                        session, work, concurrency, temperature, args.warmup_seconds, args.duration
                    )
                    points.append(
                        {
                            "config": config.name,
                            "dataset": plan.dataset,
                            "temperature": temperature,
                            "concurrency": concurrency,
                            "round": round_,
                            **row,
                        }
                    )
                    save(points, texts)
                    accept = row["server"]["accept_length"]
                    clock.log(
                        f"{config.name}{_round_tag(round_)}: {plan.dataset} T={temperature:g} "
                        f"C={concurrency}: {row['output_tok_s']:.1f} tok/s, "
                        f"{row['requests_completed']} done"
                        + (f", accept {accept:.2f}" if accept else "")
                    )
    return points, texts, {"model": model, **info}


async def _server_info(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    async with session.get(base_url + "/server_info") as resp:
        if resp.status != 200:
            return {}
        info = await resp.json()
    return {"engine_config": info.get("config"), "server_info_args": info.get("server_args")}


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


def run_configs(
    args: argparse.Namespace, launch: Callable[..., subprocess.Popen]
) -> dict[str, Any]:
    """Every configuration in turn, ``--rounds`` times (with ``--launch`` each turn on its own
    server, stopped after)."""
    clock, configs, results = Clock(), [], {"points": [], "text_check": {}}
    for round_ in range(args.rounds):
        for config in args.configs:
            name = f"{config.name}{_round_tag(round_)}"
            clock.log(f"{name}: starting" if args.launch else f"{name}: running")
            began = time.perf_counter()
            flags = [*shlex.split(args.server_args), *shlex.split(config.args)]
            entry = {
                "name": config.name,
                "round": round_,
                "args": config.args,
                "server_args": flags,
            }
            try:
                server = launch(args, shlex.split(config.args)) if args.launch else None
            except RuntimeError as e:  # NOTE: the other configurations still run
                clock.log(f"{name}: {e}")
                configs.append({**entry, "error": str(e)})
                continue
            up = time.perf_counter() - began
            if args.launch:
                clock.log(f"{name}: server up in {up:.1f} s")
            save = functools.partial(_save_partial, args.out, results, configs, config.name)
            try:
                points, texts, info = asyncio.run(
                    _config_run(args, config, args.plans, clock, save, round_)
                )
            finally:
                _stop(server)
            configs.append({**entry, "start_s": up if args.launch else None, **info})
            results["points"] += points
            if round_ == 0:
                results["text_check"][config.name] = texts
            save([], results["text_check"].get(config.name, {}))
    clock.log("done")
    results["configs"] = configs
    results["elapsed_s"] = time.perf_counter() - clock.start
    return results


def _round_tag(round_: int) -> str:
    return f" (round {round_ + 1})" if round_ else ""


def _save_partial(
    out: str | None,
    results: dict[str, Any],
    configs: list[dict[str, Any]],
    name: str,
    points: list[dict[str, Any]],
    texts: dict[str, list[str]],
) -> None:
    """Write what ran so far, with configuration ``name``'s ``points`` and ``texts`` yet to
    join ``results``, to ``<out>.partial``: a run cut short keeps every point it finished."""
    if out:
        text_check = {**results["text_check"], **({name: texts} if texts else {})}
        partial = {
            "points": results["points"] + points,
            "text_check": text_check,
            "configs": configs,
        }
        Path(f"{out}.partial").write_text(json.dumps(partial, default=str) + "\n")


def add_ratios(points: list[dict[str, Any]], first: str) -> None:
    """Each point's output tok/s over the first configuration's at the same point of the same
    round (None where that one did not run it)."""
    base = {_key(p): p["output_tok_s"] for p in points if p["config"] == first}
    for p in points:
        b = base.get(_key(p))
        p["tok_s_ratio"] = p["output_tok_s"] / b if b else None


def _key(point: dict[str, Any]) -> tuple[str, float, int, int]:
    return point["dataset"], point["temperature"], point["concurrency"], point.get("round", 0)


def summarize_rounds(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration and point (over its rounds): the median, least and greatest ratio and
    each round's output tok/s, in the order the points first ran."""
    groups: dict[tuple[str, str, float, int], list[dict[str, Any]]] = {}
    for p in points:
        key = (p["config"], p["dataset"], p["temperature"], p["concurrency"])
        groups.setdefault(key, []).append(p)
    summary = []
    for (config, dataset, temperature, concurrency), runs in groups.items():
        ratios = [r["tok_s_ratio"] for r in runs if r.get("tok_s_ratio") is not None]
        summary.append(
            {
                "config": config,
                "dataset": dataset,
                "temperature": temperature,
                "concurrency": concurrency,
                "rounds": len(runs),
                "tok_s": [r["output_tok_s"] for r in runs],
                "ratio_median": statistics.median(ratios) if ratios else None,
                "ratio_min": min(ratios, default=None),
                "ratio_max": max(ratios, default=None),
            }
        )
    return summary


def first_difference(a: str, b: str) -> int | None:
    """The first character position where ``a`` and ``b`` differ; None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_texts(texts: dict[str, dict[str, list[str]]], first: str) -> dict[str, Any]:
    """Per dataset and configuration: how many greedy texts differ from the first
    configuration's, and where each begins to (bf16 near-ties may flip a token)."""
    out: dict[str, Any] = {}
    for config, by_dataset in texts.items():
        for dataset, got in by_dataset.items():
            ref = texts.get(first, {}).get(dataset)
            diffs = (
                []
                if ref is None
                else [
                    {"index": i, "position": first_difference(a, b)}
                    for i, (a, b) in enumerate(zip(ref, got))
                    if a != b
                ]
            )
            out.setdefault(dataset, {})[config] = {
                "requests": len(got),
                "differ": None if ref is None else len(diffs),
                "first_differences": diffs,
                "texts": got,
            }
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(points: list[dict[str, Any]], text_check: dict[str, Any]) -> None:
    head = (
        f"{'config':<12}{'dataset':<12}{'T':>5}{'C':>5}{'tok/s':>10}{'ratio':>8}"
        f"{'accept':>8}{'plain':>7}{'TPOT p50':>10}{'TTFT p50':>10}{'done':>6}{'len':>6}"
    )
    print(f"{' Served speculative decoding ':=^{len(head)}}\n{head}")
    for p in points:
        spec, lengths, tpot, ttft = p["server"], p["output_len"], p["tpot"], p["ttft"]
        name = p["config"] + (f"#{p['round'] + 1}" if p.get("round") else "")
        print(
            f"{name:<12}{p['dataset']:<12}{p['temperature']:>5g}{p['concurrency']:>5}"
            f"{p['output_tok_s']:>10.1f}{_fmt(p['tok_s_ratio'], '.3f'):>8}"
            f"{_fmt(spec['accept_length'], '.2f'):>8}{_fmt(spec['plain_step_share'], '.2f'):>7}"
            f"{_fmt(tpot.get('p50_ms'), '.2f'):>10}{_fmt(ttft.get('p50_ms'), '.1f'):>10}"
            f"{p['requests_completed']:>6}{_fmt(lengths.get('mean'), '.0f'):>6}"
        )
    for p in points:
        if p["client_cpu_busy"] > 0.8:
            print(
                f"client-bound? {p['config']} {p['dataset']} T={p['temperature']:g} "
                f"C={p['concurrency']}: this process was busy {p['client_cpu_busy']:.0%} "
                "of the window"
            )
    for dataset, by_config in text_check.items():
        for config, row in by_config.items():
            if row["differ"]:
                where = ", ".join(
                    f"#{d['index']}@{d['position']}" for d in row["first_differences"]
                )
                print(
                    f"greedy text: {config} {dataset}: {row['differ']} of {row['requests']} "
                    f"differ from the first configuration ({where})"
                )
    print("=" * len(head))


def print_rounds(summary: list[dict[str, Any]]) -> None:
    """The median ratio of each point over the rounds, with its range."""
    head = f"{'config':<12}{'dataset':<12}{'T':>5}{'C':>5}{'rounds':>8}{'ratio median':>14}  range"
    print(f"{' Over the rounds ':=^{len(head) + 14}}\n{head}")
    for s in summary:
        spread = "-" if s["ratio_median"] is None else f"{s['ratio_min']:.3f}-{s['ratio_max']:.3f}"
        print(
            f"{s['config']:<12}{s['dataset']:<12}{s['temperature']:>5g}{s['concurrency']:>5}"
            f"{s['rounds']:>8}{_fmt(s['ratio_median'], '.3f'):>14}  {spread}"
        )
    print("=" * (len(head) + 14))


def sweep(args: argparse.Namespace, launch: Callable[..., subprocess.Popen]) -> dict[str, Any]:
    """The whole sweep: the runs, the ratios against the first configuration, the text check's
    differences and the table."""
    results = run_configs(args, launch)
    first = args.configs[0].name
    add_ratios(results["points"], first)
    results["text_check"] = compare_texts(results.pop("text_check"), first)
    results["datasets"] = {
        p.dataset: {
            "requests": len(DATASETS[p.dataset]),
            "concurrencies": p.concurrencies,
            "temperatures": p.temperatures,
            "configs": p.configs,
        }
        for p in args.plans
    }
    results["rounds"] = args.rounds
    results["summary"] = summarize_rounds(results["points"])
    print_table(results["points"], results["text_check"])
    if results["rounds"] > 1:
        print_rounds(results["summary"])
    return results
