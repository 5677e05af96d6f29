"""Does `nbtrain demo` tell the same story every time? Runs it 5 times in a row, each in a
fresh process as a new user's first command would, and prints each row's verdict per run
and whether the verdicts and the order of the rows agreed (issue 40).

    python bench/demo_stability.py [--runs 5] [--max-rounds 400]

Agreed means: every row has the same verdict (faster, slower, within noise, same settings
as a row above) in every run, and the timed rows come in the same order by samples/s in
every run, where two rows within 5% of each other in a run may swap. Each cell shows the
row's ratio to the timed row above with its 95% interval, and the row's spread (the width
of its rate's 95% interval, each round's machine speed factored out as in the table;
issue 40's target is at most 10%), then the raw one (the rates as measured, with the
machine's wander from round to round in them).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ONE_DEMO = """
import json, sys
from dataclasses import asdict
from nbtrain.tools.demo import run_demo
demo = run_demo(max_rounds=int(sys.argv[2]))
with open(sys.argv[1], "w") as f:
    json.dump({"lines": [asdict(line) for line in demo.lines], "rounds": demo.rounds,
               "wall_s": demo.wall_s, "own_loop": demo.own_loop}, f)
"""
SWAP_WITHIN = 0.05


def run_once(max_rounds: int) -> dict:
    """One `nbtrain demo` in a fresh process (its output goes to this one's); its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "demo.json")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", ONE_DEMO, path, str(max_rounds)], check=True)
        with open(path) as f:
            result = json.load(f)
    result["process_s"] = time.perf_counter() - start   # the interpreter's start included
    return result


def _spreads(line: dict) -> str:
    """The table's spread (each round's machine speed factored out), then the raw one."""
    raw = line.get("raw_spread")
    return f"{line['spread']:.0%}" + ("" if raw is None else f", raw {raw:.0%}")


def order_disagreements(results: list) -> list:
    """The pairs of timed rows that swapped between two runs though they were more than
    SWAP_WITHIN apart in both."""
    found = []
    labels = [line["label"] for line in results[0]["lines"]]
    for a, b in itertools.combinations(labels, 2):
        ratios = []
        for result in results:
            rates = {line["label"]: line["rate"] for line in result["lines"]
                     if line["kind"] != "same"}
            if a in rates and b in rates:
                ratios.append(rates[a] / rates[b])
        for r1, r2 in itertools.combinations(ratios, 2):
            apart = abs(r1 - 1) > SWAP_WITHIN and abs(r2 - 1) > SWAP_WITHIN
            if apart and (r1 > 1) != (r2 > 1):
                found.append((a, b))
                break
    return found


def report(results: list) -> str:
    labels = [line["label"] for line in results[0]["lines"]]
    width = max(map(len, labels)) + 2
    out = ["| row | " + " | ".join(f"run {i + 1}" for i in range(len(results))) + " | agreed |",
           "|---|" + "---|" * len(results) + "---|"]
    all_agree = True
    for k, label in enumerate(labels):
        cells, kinds = [], set()
        for result in results:
            line = result["lines"][k]
            # "within noise" and "under 10%" share a kind: a flip between them is a flip
            kinds.add((line["kind"], line["words"] if line["kind"] == "noise" else ""))
            if line["kind"] == "same":
                cells.append("same as above")
            elif line["kind"] == "base":
                cells.append(f"{line['rate']:,.0f}/s (spread {_spreads(line)})")
            else:
                words = line["words"] if line["kind"] != "noise" else \
                    f"{line['vs_above']:.2f}x, {line['words']}"
                cells.append(f"{words} ({line['low']:.2f}-{line['high']:.2f}; spread "
                             f"{_spreads(line)})")
        agreed = len(kinds) == 1
        all_agree &= agreed
        out.append(f"| {label:<{width}}| " + " | ".join(cells) + f" | {'yes' if agreed else 'NO'} |")
    swapped = order_disagreements(results)
    own = [r["own_loop"]["ratio"] for r in results if r.get("own_loop")]
    widest = [max(line["spread"] for line in r["lines"] if line["kind"] != "same")
              for r in results]
    widest_raw = [max((line["raw_spread"] for line in r["lines"] if line["kind"] != "same"
                       and line.get("raw_spread") == line.get("raw_spread")), default=math.nan)
                  for r in results]   # (x == x: not NaN, which max() would place by order)
    out += ["", "verdicts agreed in every run: " + ("yes" if all_agree else "NO"),
            "order of the timed rows agreed (rows within 5% may swap): "
            + ("yes" if not swapped else "NO: " + "; ".join(f"{a} / {b}" for a, b in swapped)),
            "every row's spread at most 10%: " + ("yes" if max(widest) <= 0.10 else "NO")
            + " (the widest per run: " + ", ".join(f"{w:.0%}" for w in widest) + ")",
            "the widest spread of the rates as measured, the machine's wander between rounds "
            "in it, per run: " + ", ".join(f"{w:.0%}" for w in widest_raw),
            "timing rounds per run: " + ", ".join(str(r["rounds"]) for r in results),
            "demo wall time per run (s): " + ", ".join(f"{r['wall_s']:.0f}" for r in results)
            + " (the process, interpreter start included: "
            + ", ".join(f"{r['process_s']:.0f}" for r in results) + ")",
            "vs plain of the defaults (last row): " + ", ".join(
                f"{r['lines'][-1]['vs_plain']:.2f}x" for r in results if r['lines'][-1]['kind']
                != "same"),
            "own loop under nt.watch(), time vs as written: " + ", ".join(f"{x:.2f}x" for x in own)]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-rounds", type=int, default=400)
    args = parser.parse_args(argv)
    from nbtrain.machine import machine_line
    print(machine_line(), f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for i in range(args.runs):
        print(f"\n=== demo {i + 1}/{args.runs} (load {os.getloadavg()[0]:.1f}) ===", flush=True)
        results.append(run_once(args.max_rounds))
    print(f"\n=== {args.runs} demos in a row (load average at the end "
          f"{os.getloadavg()[0]:.1f}) ===\n" + report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
