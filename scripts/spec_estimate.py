"""The speedup a speculative method would reach at measured accept lengths, from step times.

``bench_spec.py --accept-lengths FILE`` times the plain decode step and the speculative step
(the draft's k proposal steps, the target's verify pass over k+1 tokens, the draft's catch-up,
commit: graphs captured, as the engine runs them) in one run, then estimates

    speedup = accept_length * t_plain / t_spec_step

per dataset of ``FILE`` (a ``measure_accept.py`` result): a speculative step yields
``accept_length`` tokens where a plain step yields one. Every pass of the step has a fixed
shape (k draft steps, k+1 verify rows, a catch-up padded to k+1 rows per request), so its time
does not depend on how many drafts are accepted: the step is timed with whatever the run's
draft accepts (random weights: about 1) and applied at the measured lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

HOW = (
    "speedup = accept_length * t_plain / t_spec_step: t_plain the plain engine's median decode "
    "step, t_spec_step the speculative engine's median step with every step speculating, both "
    "{timer}, in this run; accept_length measured by measure_accept.py ({source}). Each "
    "speculative step has fixed shapes (k draft steps, k+1 verify rows, a catch-up padded to "
    "k+1 rows), so its time does not depend on the accept length of this run's draft."
)


def accept_lengths(path: str | Path) -> dict[str, float]:
    """Dataset -> accept length of a ``measure_accept.py`` JSON file."""
    data = json.loads(Path(path).read_text())
    try:
        return {name: float(d["accept_length"]) for name, d in data["datasets"].items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path}: expected measure_accept.py output ('datasets' -> name -> 'accept_length')"
        ) from exc


def speed_estimate(rows: list[dict], accept_path: str | Path, method: str = "STANDALONE") -> dict:
    """Per (prompt set, batch) row of ``method`` in ``bench_spec.py``'s ``rows``: the step
    times (CUDA-event step periods where there are, else wall medians) and the estimated
    speedup at each dataset's accept length."""
    accept = accept_lengths(accept_path)
    plain = {(r["prompts"], r["batch"]): r for r in rows if r["method"] == "none"}
    timer, out = "wall-clock medians", []
    for row in (r for r in rows if r["method"] == method):
        base = plain[(row["prompts"], row["batch"])]
        t_plain, t_spec = base.get("decode_step_gpu_ms"), row.get("spec_step_gpu_ms")
        if t_plain is not None and t_spec is not None:
            timer = "CUDA-event step periods (one step's start to the next's)"
        else:
            t_plain, t_spec = base["decode_step_ms"], row["spec_step_ms"]
        out.append(
            {
                "prompts": row["prompts"],
                "batch": row["batch"],
                "plain_step_ms": t_plain,
                "spec_step_ms": t_spec,
                "run_accept_length": row["avg_accept_length"],
                "speedup": {name: a * t_plain / t_spec for name, a in accept.items()},
            }
        )
    return {
        "method": method,
        "how": HOW.format(timer=timer, source=Path(accept_path).name),
        "accept_lengths": accept,
        "rows": out,
    }


def print_estimate(estimate: dict) -> None:
    names = list(estimate["accept_lengths"])
    print(f"\nestimated {estimate['method']} speedup ({estimate['how']})")
    print(
        f"{'prompts':>8} {'batch':>5} {'plain ms':>9} {'spec ms':>9} "
        + " ".join(f"{n + ' ' + format(estimate['accept_lengths'][n], '.2f'):>14}" for n in names)
    )
    for r in estimate["rows"]:
        print(
            f"{r['prompts']:>8} {r['batch']:>5} {r['plain_step_ms']:>9.3f} "
            f"{r['spec_step_ms']:>9.3f} " + " ".join(f"{r['speedup'][n]:>13.2f}x" for n in names)
        )
