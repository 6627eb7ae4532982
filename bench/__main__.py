"""Run the benchmarks: ``python -m bench [--quick] [--only NAME ...]``.

Targets (issue 3): 1 control plane, 2 global server scale, 3 parameter plane, 4 pulls,
5 training throughput, 6 time to accuracy; (issue 11) 7 rule exchange; (issue 12) 8 mixed node
speeds, 9 the Platoon comparison; (issue 15) 10 the parameter plane (root: network namespaces). Each prints its measured value, the baseline
measured in the same run, and their ratio. Results go to ``bench/results.json`` and to the
results block of ``docs/benchmarks.md`` (the rest of that file is written by hand).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback

from .common import REPO, Result, machine

BENCHES = {
    "control": ("bench.control", "run"),
    "scale": ("bench.scale", "run"),
    "params": ("bench.params", "run"),
    "pulls": ("bench.pulls", "run"),
    "throughput": ("bench.throughput", "run_throughput"),
    "accuracy": ("bench.throughput", "run_accuracy"),
    "exchange": ("bench.exchange", "run"),
    "hetero": ("bench.hetero", "run"),
    "platoon": ("bench.platoon", "run"),
    "plane": ("bench.plane", "run"),
}
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    text = f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{text} {unit}".strip()


def table(results: list[Result]) -> str:
    lines = ["| target | measured | value | baseline (same run) | ratio | goal | met |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        base = f"{_fmt(r.baseline, r.unit)} ({r.baseline_name})" if r.baseline is not None else "–"
        ratio = f"{_fmt(r.ratio)}x ({r.ratio_note})" if r.ratio is not None else "–"
        met = {True: "yes", False: "**no**", None: "–"}[r.met]
        lines.append(f"| {r.target} | {r.metric} | {_fmt(r.value, r.unit)} | {base} | {ratio} | "
                     f"{r.goal or '–'} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (about 3 minutes in all)")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run only these")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    names = args.only or list(BENCHES)
    results: list[Result] = []
    failed: list[str] = []
    t0 = time.monotonic()
    for name in names:
        module, func = BENCHES[name]
        started = time.monotonic()
        print(f"== {name} ...", flush=True)
        try:
            fn = getattr(importlib.import_module(module), func)
            kwargs = {"plot": REPO / "docs" / "time_to_accuracy.png"} if name == "accuracy" else {}
            got = fn(args.quick, **kwargs)
        except Exception:  # report and go on with the other benchmarks
            traceback.print_exc()
            failed.append(name)
            continue
        results += got
        print(table(got), f"\n({time.monotonic() - started:.0f} s)", flush=True)
    info = machine()
    command = "python -m bench" + (" --quick" if args.quick else "") + (
        f" --only {' '.join(args.only)}" if args.only else "")
    run = {"command": command, "date": info["date"], "seconds": round(time.monotonic() - t0, 1)}
    for r in results:
        r.extra["run"] = run
    path = REPO / "bench" / "results.json"
    kept: list[dict] = []
    if args.only and path.exists():  # a partial run replaces only its own targets
        new_targets = {r.target for r in results}
        kept = [r for r in json.loads(path.read_text())["results"] if r["target"] not in new_targets]
    merged = kept + [r.to_dict() for r in results]
    merged.sort(key=lambda r: r["target"])
    payload = {"machine": info, "results": merged, "failed": failed}
    path.write_text(json.dumps(payload, indent=2, default=str))
    print("\n" + table(results))
    if not args.no_docs:
        _update_docs([Result(**r) for r in merged], info)
    if failed:
        print(f"benchmarks that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _update_docs(results: list[Result], info: dict) -> None:
    path = REPO / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    runs: dict[str, dict] = {}
    for r in results:
        run = r.extra.get("run", {})
        runs.setdefault(run.get("command", "?"), run)
    made = "; ".join(f"`{c}` ({run.get('seconds', 0):.0f} s, {run.get('date', '?')}, targets "
                     f"{', '.join(sorted({r.target.split('.')[0] for r in results if r.extra.get('run', {}).get('command') == c}))})"
                     for c, run in runs.items())
    block = (f"{START}\nProduced by {made}.\n"
             f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; "
             f"Python {info['python']}, numpy {info['numpy']}, grpcio {info['grpcio']}.\n\n"
             f"{table(results)}\n{END}")
    if START in text and END in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END):]
    else:
        text += "\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
