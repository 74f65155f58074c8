#!/usr/bin/env python3
"""Merges mobius_kernel_bench JSON files (ours) and a peers.py JSON into one report.

usage: compare.py --ours A.json [B.json ...] [--peers P.json ...] [--markdown OUT.md] [--json OUT.json]
       compare.py --merged kbench.json [--markdown OUT.md]

Prints (and writes as Markdown) two tables:
  1. every case of ours: median time, bytes, FLOPs, bound = max(bytes / copy bandwidth,
     FLOPs / bf16 matrix rate), time / bound, achieved GB/s;
  2. ours against the peers at the same shapes: for each case the peer's time (CUDA-graph replay
     per call when capture worked, else eager), its eager time, the shared bound, and peer / ours
     (> 1: ours is faster). For PyTorch SDPA the fastest backend that ran is shown.
Standard library only (runs anywhere).
"""
import argparse
import json
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def fmt_bytes(b):
    if b >= 1e9:
        return f"{b / 1e9:.2f} GB"
    if b >= 1e6:
        return f"{b / 1e6:.2f} MB"
    return f"{b / 1e3:.1f} KB"


def table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    text = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + "\n"
    text += "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)
    md = "| " + " | ".join(headers) + " |\n| " + " | ".join("---" for _ in headers) + " |\n"
    md += "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
    return text, md


def family(impl):
    return "torch.sdpa" if impl.startswith("torch.sdpa") else impl


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", nargs="+", default=[])
    ap.add_argument("--merged", default="", help="a kbench.json written by --json (re-renders it)")
    ap.add_argument("--peers", nargs="*", default=[], help="peers.py JSON files (merged)")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--title", default="")
    args = ap.parse_args()

    ours, meta, failed = [], None, []
    if args.merged:  # re-render an earlier report's kbench.json
        j = load(args.merged)
        args.ours, args.peers = [], []
        meta, ours = j["ours"], j["ours"]["cases"]
    for p in args.ours:
        try:
            j = load(p)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{p}: {e}")
            continue
        meta = meta or j
        ours.extend(j["cases"])
    if meta is None:
        sys.exit("compare.py: no readable result of ours: " + "; ".join(failed))
    peers = load(args.merged)["peers"] if args.merged else None
    for p in args.peers:
        try:
            j = load(p)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{p}: {e}")
            continue
        if peers is None:
            peers = j
        else:
            peers["cases"].extend(j["cases"])
    by_name = {c["name"]: c for c in ours}

    out_text, out_md = [], []
    head = (f"GPU {meta['gpu']} ({meta.get('device', '')}); {meta['date']}; {meta.get('note', '')}\n"
            f"ceilings (same run): copy {meta['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s "
            f"[{meta.get('copy_bandwidth_source', '')}], bf16 matrix "
            f"{meta['matrix_flops_per_s'] / 1e12:.1f} TFLOP/s [{meta.get('matrix_source', '')}]")
    if peers:
        head += (f"\npeers: torch {peers.get('torch')}, triton {peers.get('triton')}, "
                 f"flash-linear-attention {peers.get('fla')}")
    if failed:
        head += "\nmissing results (a group failed): " + "; ".join(failed)
    out_text.append(head)
    out_md.append(head.replace("\n", "  \n"))

    rows = []
    for c in ours:
        gaps = " (host gaps)" if c.get("gap_batches") else ""
        timing = " (host-timed)" if c.get("timing") == "host" else ""
        rows.append([c["name"], c["op"], f"{c['time_us']:.2f}{gaps}{timing}", f"{c['min_us']:.2f}",
                     f"{c['host_us']:.1f}", fmt_bytes(c["bytes"]),
                     f"{c['flops'] / 1e9:.3g}", f"{c['bound_us']:.2f} ({c['bound_by']})",
                     f"{c['ratio']:.2f}", f"{c['bytes'] / (c['time_us'] * 1e-6) / 1e9:.0f}"])
    t, m = table(["case", "op", "ours us", "min us", "host us", "bytes", "GFLOP", "bound us",
                  "x bound", "GB/s"], rows)
    out_text.append("\n1. Our ops (median per call, back to back on the device)\n" + t)
    out_md.append("\n**Our ops** (median per call, back to back on the device)\n\n" + m)

    if peers:
        best = {}
        for p in peers["cases"]:
            if "time_us" not in p:
                continue
            key = (p["name"], family(p["impl"]))
            if key not in best or p["time_us"] < best[key]["time_us"]:
                best[key] = p
        rows = []
        order = {}
        for i, c in enumerate(ours):
            base = c["name"].rsplit(".", 1)[0] if c["name"].endswith((".auto", ".recurrent", ".chunked")) else c["name"]
            order.setdefault(base, i)
        for (name, fam), p in sorted(best.items(), key=lambda kv: (order.get(kv[0][0], 1e9), kv[0])):
            o = by_name.get(name + ".auto") or by_name.get(name)
            variants = [by_name[name + s] for s in (".recurrent", ".chunked") if name + s in by_name]
            ours_us = f"{o['time_us']:.2f}" if o else "-"
            if variants:
                ours_us += " (" + ", ".join(f"{v['name'].rsplit('.', 1)[1]} {v['time_us']:.0f}"
                                            for v in variants) + ")"
            # Our graph-replayed time is measured the way the peer's is: the like-for-like ratio.
            graph = o.get("graph_us", 0) if o else 0
            rows.append([
                name, ours_us, f"{graph:.2f}" if graph else "-", p["impl"], f"{p['time_us']:.2f}",
                f"{p['eager_us']:.2f}", f"{p['bound_us']:.2f}",
                f"{o['ratio']:.2f}" if o else "-", f"{p['ratio']:.2f}",
                f"{p['time_us'] / o['time_us']:.2f}" if o else "-",
                f"{p['time_us'] / graph:.2f}" if graph else "-",
            ])
        t, m = table(["case", "ours us", "ours graph us", "peer", "peer us", "peer eager us",
                      "bound us", "ours x bound", "peer x bound", "peer / ours",
                      "peer / ours graph"], rows)
        out_text.append("\n2. Ours vs peers (same shapes, same bounds; peer us = CUDA-graph replay "
                        "per call, eager = do_bench with Python overhead; peer / ours > 1: ours faster)\n" + t)
        out_md.append("\n**Ours vs peers** (same shapes and bounds; peer us = CUDA-graph replay per "
                      "call, eager = `triton.testing.do_bench` median incl. Python overhead; "
                      "peer / ours > 1: ours is faster)\n\n" + m)
        grouped = {}
        for p in peers["cases"]:
            if "error" in p:
                grouped.setdefault(f"{p['impl']}: {p['error']}", []).append(p["name"])
        errors = [f"{k} ({', '.join(v)})" for k, v in grouped.items()]
        if errors:
            out_text.append("\npeer cases that did not run:\n  " + "\n  ".join(errors))
            out_md.append("\nPeer cases that did not run: " + "; ".join(errors))
        out_text.append("\nnotes:\n  " + "\n  ".join(peers.get("notes", [])))
        out_md.append("\nNotes: " + " ".join(peers.get("notes", [])))

    print("\n".join(out_text))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(out_md) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ours": meta | {"cases": ours}, "peers": peers}, f, indent=1)


if __name__ == "__main__":
    main()
