#!/usr/bin/env python3
"""Per-kernel breakdown of one engine step from an Nsight Compute CSV.

Collect the CSV on the GPU host (the recorded decode step replays node by node under ncu; each
kernel runs alone with caches flushed, so the sum is close to, not equal to, the replayed step):

  ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum --csv \
      --print-units base run.sh mobius bench engine --config 35b.json --load-format dummy \
      --device cuda --batches 1 --contexts 1024 --prefill-lengths '' --steps 1 > step.csv

then, anywhere:

  ncu_step.py step.csv                 # the last step, biggest totals first
  ncu_step.py step.csv --step -2 --top 40 --markdown

A step starts at each launch of the embedding gather (`--marker`, default GatherRowsVecKernel);
`--step N` picks the N-th (Python indexing: -1 is the last). A prefill step gathers again for
its last rows before the lm_head, so it shows as two: the layers, then the lm_head. Kernels are grouped by name and
grid, since one kernel serves projections of several shapes. Standard library only.
"""
import argparse
import collections
import csv
import re
import sys


def read_rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"{path}: no CSV rows (was ncu run with --csv?)")
    header, body = rows[0], rows[1:]
    try:
        cols = {name: header.index(name) for name in
                ("Kernel Name", "Grid Size", "Block Size", "Metric Name", "Metric Value")}
    except ValueError as e:
        sys.exit(f"{path}: missing column ({e})")
    out = []
    for r in body:
        if r[cols["Metric Name"]] != "gpu__time_duration.sum":
            continue
        out.append({
            "name": r[cols["Kernel Name"]],
            "grid": r[cols["Grid Size"]],
            "block": r[cols["Block Size"]],
            "ns": float(r[cols["Metric Value"]].replace(",", "")),
        })
    return out


def short_name(name):
    name = re.sub(r"\(.*", "", name)  # parameter list
    for prefix in ("void ", "mobius::<unnamed>::", "mobius::kernels::cuda::"):
        name = name.replace(prefix, "")
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --csv output with gpu__time_duration.sum")
    ap.add_argument("--marker", default="GatherRowsVecKernel",
                    help="kernel whose launches start a step (default: %(default)s)")
    ap.add_argument("--step", type=int, default=-1, help="which step (default: the last)")
    ap.add_argument("--top", type=int, default=30, help="rows to print (default: %(default)s)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args()

    rows = read_rows(args.csv)
    starts = [i for i, r in enumerate(rows) if args.marker in r["name"]]
    if not starts:
        sys.exit(f"no launch of {args.marker} in {args.csv}: pass --marker")
    try:
        begin = starts[args.step]
    except IndexError:
        sys.exit(f"--step {args.step}: the file has {len(starts)} steps")
    later = [s for s in starts if s > begin]
    step = rows[begin:later[0] if later else len(rows)]

    groups = collections.OrderedDict()
    for r in step:
        key = (short_name(r["name"]), r["grid"], r["block"])
        g = groups.setdefault(key, [0, 0.0])
        g[0] += 1
        g[1] += r["ns"]
    total = sum(g[1] for g in groups.values())
    print(f"step {args.step} of {len(starts)}: {len(step)} kernels, {total / 1e3:.1f} us summed")
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:args.top]
    if args.markdown:
        print("| kernel | grid | block | calls | us each | us total | share |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
    for (name, grid, block), (calls, ns) in ranked:
        each, share = ns / calls / 1e3, 100 * ns / total
        if args.markdown:
            print(f"| {name} | {grid} | {block} | {calls} | {each:.2f} | {ns / 1e3:.1f} | "
                  f"{share:.1f}% |")
        else:
            print(f"{ns / 1e3:9.1f} us {calls:4d} x {each:8.2f} us {share:5.1f}%  "
                  f"{grid:>14} {block:>12}  {name}")


if __name__ == "__main__":
    main()
