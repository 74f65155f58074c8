#!/usr/bin/env python3
"""Peer kernels at the shapes of mobius_kernel_bench, with the same bytes, FLOPs and bounds.

Peers (they are not part of our build):
  - flash-linear-attention (fla), Triton: chunk_gated_delta_rule and
    fused_recurrent_gated_delta_rule. Not installed on the GPU host: put a copy of its Python source
    on PYTHONPATH (run_on_device.sh uses .peers/, git-ignored). Needs einops and transformers.
  - PyTorch scaled_dot_product_attention (GQA 16/2, head_dim 256), contiguous (non-paged) K/V,
    through each SDPA backend that accepts the shape.

Semantics are those of our ops: q/k l2-normalised inside the kernel (use_qk_l2norm_in_kernel),
scale Dk^-0.5, g in log space (fp32), beta fp32 (post-sigmoid), fp32 state [N, Hv, Dk, Dv] given
as initial state and returned as final state; 8 x 1024 runs as a batch of 8 equal-length
sequences. Differences (listed in the JSON's "notes" too): fla takes q, k, v as three contiguous
tensors where our op reads one packed qkv row; fla allocates and writes a new final-state tensor
where ours updates the state slots in place (the same bytes); SDPA reads contiguous K/V where ours
reads a paged cache through block tables.

Timing: each case is timed two ways, both over input sets rotated so that the L2 does not hold
them (sets * bytes >= 4 x L2):
  graph: N calls captured in one CUDA graph, replayed; time per call = replay time / N (median of
         several replays): the kernels back to back without Python/launch overhead. This is the
         number compared with ours (which is also timed back to back on the device).
  eager: triton.testing.do_bench median (it flushes the L2 between calls); includes the Python
         and launch overhead of the wrapper when the kernels are shorter than it.

usage: peers.py [--json FILE] [--filter REGEX] [--bandwidth GBPS] [--matrix-tflops TF]
                [--budget-s S]
"""
import argparse
import json
import math
import os
import re
import sys
import time
import traceback

import torch

HK, HV, DK, DV = 16, 32, 128, 128
NH, NKV, HD = 16, 2, 256
CONV_DIM = 2 * HK * DK + HV * DV
DECODE_BATCHES = [1, 8, 64, 256]
CONTEXTS = [1024, 8192]
PREFILL = 4096
MULTI = (8, 1024)


def k_name(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class Ceilings:
    def __init__(self, bandwidth, matrix_rate):
        self.bandwidth = bandwidth
        self.matrix_rate = matrix_rate
        self.source = "given"

    @staticmethod
    def measure():
        n = 1 << 30  # 1 GiB copy, bytes read + written
        a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        b = torch.empty_like(a)
        ts = []
        for i in range(8):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            e.synchronize()
            if i >= 2:
                ts.append(s.elapsed_time(e) * 1e-3)
        bw = 2 * n / min(ts)
        del a, b
        m = 8192
        x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            x @ w.t()
        ts = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            x @ w.t()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e-3)
        c = Ceilings(bw, 2 * m**3 / median(ts))
        c.source = "measured by peers.py (torch copy_, torch matmul 8192^3 bf16)"
        return c


class Runner:
    def __init__(self, args, ceilings):
        self.args = args
        self.ceil = ceilings
        self.l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.results = []
        self.t0 = time.time()
        self.filter = re.compile(args.filter)

    def sets(self, nbytes):
        return int(min(64, max(1, math.ceil(4 * self.l2 / max(nbytes, 1)))))

    def bound(self, nbytes, flops):
        mem = nbytes / self.ceil.bandwidth * 1e6
        mma = flops / self.ceil.matrix_rate * 1e6
        return (mma, "mma") if mma > mem else (mem, "mem")

    def time_graph(self, calls, reps=5):
        """Per-call time of the calls run back to back from one CUDA graph (None if capture fails)."""
        n = len(calls)
        per = max(1, 64 // n)  # capture at least ~64 calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for f in calls:  # warm-up on the capture stream
                f()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(per):
                for f in calls:
                    f()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3 / (per * n))
        del g
        return median(ts)

    def time_eager(self, calls):
        import triton.testing

        i = [0]

        def f():
            calls[i[0] % len(calls)]()
            i[0] += 1

        return triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3

    def case(self, name, impl, shape, nbytes, flops, make_calls, note=""):
        if not self.filter.search(f"{name} {impl}"):
            return
        if time.time() - self.t0 > self.args.budget_s:
            print(f"  {name:28s} {impl:26s} skipped: over the --budget-s", flush=True)
            self.results.append(dict(name=name, impl=impl, shape=shape, error="skipped (time budget)"))
            return
        r = dict(name=name, impl=impl, shape=shape, bytes=nbytes, flops=flops, note=note)
        b, by = self.bound(nbytes, flops)
        r.update(bound_us=b, bound_by=by)
        t_start = time.time()
        try:
            with torch.inference_mode():
                calls, extra_note = make_calls()
                if extra_note:
                    r["note"] = (note + "; " + extra_note).strip("; ")
                r["sets"] = len(calls)
                for f in calls:  # first calls: Triton compilation and autotuning
                    f()
                torch.cuda.synchronize()
                r["eager_us"] = self.time_eager(calls)
                try:
                    r["graph_us"] = self.time_graph(calls)
                except Exception as e:  # noqa: BLE001
                    r["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                    torch.cuda.synchronize()
                r["time_us"] = r.get("graph_us", r["eager_us"])
                r["timing"] = "graph" if "graph_us" in r else "eager"
                r["ratio"] = r["time_us"] / b if b > 0 else 0
            del calls
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        torch.cuda.empty_cache()
        if "error" in r:
            print(f"  {name:28s} {impl:26s} ERROR {r['error'][:200]}", flush=True)
        else:
            print(
                f"  {name:28s} {impl:26s} {r['time_us']:10.2f} us ({r['timing']}; eager "
                f"{r['eager_us']:.2f} us) bound {b:.2f} us x{r['ratio']:.2f}  "
                f"[{time.time() - t_start:.1f} s]",
                flush=True,
            )
        self.results.append(r)
        self.save()

    def save(self):
        if not self.args.json:
            return
        with open(self.args.json, "w") as f:
            json.dump(
                dict(
                    tool="peers.py",
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    gpu=torch.cuda.get_device_name(0),
                    torch=torch.__version__,
                    triton=_version("triton"),
                    fla=os.environ.get("FLA_COMMIT", _fla_commit()),
                    copy_bandwidth_bytes_per_s=self.ceil.bandwidth,
                    matrix_flops_per_s=self.ceil.matrix_rate,
                    ceilings_source=self.ceil.source,
                    notes=NOTES,
                    cases=self.results,
                ),
                f,
                indent=1,
            )


NOTES = [
    "fla takes q, k, v as separate contiguous [B, T, H, D] tensors; ours reads one packed qkv row "
    "per token (the conv output). Same bytes.",
    "fla writes a new final-state tensor; ours updates the state slots in place (same bytes: the "
    "state is read once and written once).",
    "fla (use_qk_l2norm_in_kernel=True) and ours both l2-normalise q and k inside the kernel; "
    "scale Dk^-0.5; g in log space (fp32); beta fp32, already sigmoid-ed; fp32 state.",
    "8 x 1024 runs in fla as a batch of 8 equal-length sequences; ours as 8 packed segments.",
    "SDPA reads contiguous K/V [B, 2, ctx, 256] (enable_gqa); ours reads a paged cache (blocks of 16 "
    "positions in random order) through block tables.",
    "peer time = CUDA-graph replay per call (no Python or launch overhead); eager = "
    "triton.testing.do_bench median, with those overheads.",
    "fla's fused_recurrent kernel faulted (illegal memory access) on the H200 with Triton 3.6 / "
    "torch 2.11 at T = 4096 in both tries (one with slack after the inputs), and "
    "intermittently in the second decode case of a process; run_on_device.sh therefore runs each "
    "fla case in its own process.",
]


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return "?"


def _fla_commit():
    for p in sys.path:
        f = os.path.join(p, "FLA_COMMIT")
        if os.path.exists(f):
            return open(f).read().strip()
    return "?"


def gdr_bytes_flops(n, t_per):
    t = n * t_per
    nbytes = t * CONV_DIM * 2 + t * HV * 8 + 2 * n * HV * DK * DV * 4 + t * HV * DV * 2
    flops = 7.0 * t * HV * DK * DV
    return nbytes, flops


def gdr_cases(run):
    names = [f"gdr.decode.B{b} fla.fused_recurrent" for b in DECODE_BATCHES]
    for n, t_per in [(1, PREFILL), MULTI]:
        names += [f"gdr.prefill.{n}x{k_name(t_per)} {impl}" for impl in ("fla.fused_recurrent", "fla.chunk")]
    if not any(run.filter.search(n) for n in names):
        return  # nothing selected: do not import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def make(n, t_per, fn):
        def build():
            nbytes, _ = gdr_bytes_flops(n, t_per)
            calls = []
            note = ""
            beta_dtype = torch.float32
            for _ in range(run.sets(nbytes)):
                q = torch.empty(n, t_per, HK, DK, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
                k = torch.empty_like(q).uniform_(-1, 1)
                v = torch.empty(n, t_per, HV, DV, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
                g = torch.empty(n, t_per, HV, dtype=torch.float32, device="cuda").uniform_(-0.5, -0.01)
                beta = torch.empty(n, t_per, HV, dtype=torch.float32, device="cuda").uniform_(0.05, 0.95)
                h0 = torch.empty(n, HV, DK, DV, dtype=torch.float32, device="cuda").uniform_(-0.05, 0.05)

                def call(q=q, k=k, v=v, g=g, beta=beta, h0=h0):
                    return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)

                calls.append(call)
            try:
                calls[0]()
            except Exception as e:  # noqa: BLE001  fp32 beta refused: fall back to bf16
                note = f"beta bf16 (fp32 refused: {type(e).__name__})"
                for c in calls:
                    c.__defaults__ = c.__defaults__[:4] + (c.__defaults__[4].bfloat16(),) + c.__defaults__[5:]
            return calls, note

        return build

    for b in DECODE_BATCHES:
        nb, fl = gdr_bytes_flops(b, 1)
        run.case(f"gdr.decode.B{b}", "fla.fused_recurrent", f"{b} seq x 1 tok", nb, fl,
                 make(b, 1, fused_recurrent_gated_delta_rule))
    for n, t_per in [(1, PREFILL), MULTI]:
        nb, fl = gdr_bytes_flops(n, t_per)
        name = f"gdr.prefill.{n}x{k_name(t_per)}"
        run.case(name, "fla.fused_recurrent", f"{n} seq x {t_per} tok", nb, fl,
                 make(n, t_per, fused_recurrent_gated_delta_rule))
    for n, t_per in [(1, PREFILL), MULTI]:
        nb, fl = gdr_bytes_flops(n, t_per)
        name = f"gdr.prefill.{n}x{k_name(t_per)}"
        run.case(name, "fla.chunk", f"{n} seq x {t_per} tok", nb, fl,
                 make(n, t_per, chunk_gated_delta_rule))


SDPA_BACKENDS = ["default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]


def sdpa_cases(run):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(b, sq, ctx, causal, backend):
        def build():
            nbytes = 2 * b * sq * NH * HD * 2 + b * ctx * 2 * NKV * HD * 2
            calls = []
            for _ in range(run.sets(nbytes)):
                q = torch.empty(b, NH, sq, HD, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
                k = torch.empty(b, NKV, ctx, HD, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
                v = torch.empty_like(k).uniform_(-1, 1)

                def call(q=q, k=k, v=v):
                    if backend == "default":
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

                calls.append(call)
            return calls, ""

        return build

    for b in DECODE_BATCHES:
        for ctx in CONTEXTS:
            nbytes = 2 * b * NH * HD * 2 + b * ctx * 2 * NKV * HD * 2
            flops = 4.0 * NH * HD * b * ctx
            for be in SDPA_BACKENDS:
                run.case(f"attn.decode.B{b}.ctx{k_name(ctx)}", f"torch.sdpa.{be.lower()}",
                         f"q [{b}, {NH}, 1, {HD}], kv [{b}, {NKV}, {ctx}, {HD}]", nbytes, flops,
                         make(b, 1, ctx, False, be))
    nbytes = 2 * PREFILL * NH * HD * 2 + PREFILL * 2 * NKV * HD * 2
    flops = 4.0 * NH * HD * PREFILL * (PREFILL + 1) / 2
    for be in SDPA_BACKENDS:
        run.case(f"attn.prefill.1x{k_name(PREFILL)}", f"torch.sdpa.{be.lower()}",
                 f"q [1, {NH}, {PREFILL}, {HD}], kv [1, {NKV}, {PREFILL}, {HD}], causal", nbytes,
                 flops, make(1, PREFILL, PREFILL, True, be))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    ap.add_argument("--filter", default=".*", help="regex on 'case impl'")
    ap.add_argument("--bandwidth", type=float, default=0, help="copy bandwidth GB/s (else measured)")
    ap.add_argument("--matrix-tflops", type=float, default=0, help="bf16 matrix rate (else measured)")
    ap.add_argument("--ceilings-from", default="", help="take both ceilings from a mobius_kernel_bench JSON")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the cases that start after this")
    ap.add_argument("--skip-fla", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peers.py: no CUDA device")
    if args.ceilings_from:
        j = json.load(open(args.ceilings_from))
        ceil = Ceilings(j["copy_bandwidth_bytes_per_s"], j["matrix_flops_per_s"])
        ceil.source = f"from {args.ceilings_from} (mobius_kernel_bench, same run)"
    elif args.bandwidth > 0 and args.matrix_tflops > 0:
        ceil = Ceilings(args.bandwidth * 1e9, args.matrix_tflops * 1e12)
    else:
        ceil = Ceilings.measure()
    print(f"peers.py on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton "
          f"{_version('triton')}; ceilings {ceil.bandwidth / 1e9:.0f} GB/s, "
          f"{ceil.matrix_rate / 1e12:.1f} TFLOP/s ({ceil.source})", flush=True)
    run = Runner(args, ceil)
    if not args.skip_fla:  # the main peer first: its Triton autotuning takes a while
        try:
            gdr_cases(run)
        except ImportError as e:
            print(f"peers.py: flash-linear-attention not importable ({e}); put its source on PYTHONPATH",
                  flush=True)
            run.results.append(dict(name="gdr.*", impl="fla", error=f"ImportError: {e}"))
    sdpa_cases(run)
    run.save()


if __name__ == "__main__":
    main()
