"""Plot a served speculative-decoding sweep of ``bench_serving.py``: each configuration's output
tok/s over the first configuration's against concurrency, one line per configuration, dataset
and temperature (the median over ``--rounds``). Writes ``RESULT.png`` beside ``RESULT.json``;
needs matplotlib (the ``bench`` extra: ``pip install -e '.[bench]'``) and says so, exiting 0,
without it.

    python scripts/plot_serving.py bench/results/served_spec_smollm2_h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from serving_compare import summarize_rounds


def ratio_lines(record: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Label -> (concurrency, tok/s ratio) points, ascending, of every configuration but the
    first (the reference, 1.0 everywhere); over several rounds, the median ratio."""
    first = record["configs"][0]["name"]
    lines: dict[str, list[tuple[int, float]]] = {}
    for s in summarize_rounds(record["points"]):
        if s["config"] != first and s["ratio_median"] is not None:
            label = f"{s['config']} {s['dataset']} T={s['temperature']:g}"
            lines.setdefault(label, []).append((s["concurrency"], s["ratio_median"]))
    return {label: sorted(points) for label, points in lines.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="a JSON file of bench_serving.py's sweep")
    path = Path(p.parse_args(argv).result)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return 0
    record = json.loads(path.read_text())
    first = record["configs"][0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in ratio_lines(record).items():
        ax.plot(*zip(*points), marker="o", label=label)
    ax.axhline(1.0, color="grey", linestyle="--", label=first["name"])
    concurrencies = sorted({p["concurrency"] for p in record["points"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.minorticks_off()
    ax.set(
        xlabel="concurrency (requests in flight)",
        ylabel=f"output tok/s / {first['name']}",
        title=f"{first.get('model', '')}, {record.get('device')}",
    )
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
