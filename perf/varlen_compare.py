#!/usr/bin/env python3
"""Variable-length batches side by side on one GPU: kfa (perf/kfa_bench_varlen: the packed call and the
fixed-length call at equal FLOPs or at the same lengths) and PyTorch's variable-length path on the same
lengths, dtype, heads and head dim, in the same run. PyTorch's path: torch.nn.attention.varlen.varlen_attn
(FlashAttention's varlen kernels) where the installed torch has it, else scaled_dot_product_attention on
nested jagged tensors. PyTorch is the yardstick here, never a dependency of kfa.

  python3 perf/varlen_compare.py --kfa-bench build/perf/kfa_bench_varlen [--dtype bf16] [--d 128]
         [--hidden 2048] [--causal 0,1] [--reps 20] [bench options: --tokens --min --max --median --sigma --seed
         or --lengths]

FLOPs as kfa_bench_varlen: forward 4·H·d·Σ L² (halved for causal), forward+backward 3.5x that.
"""
import argparse
import inspect
import subprocess
import sys

import torch

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_varlen():
    """(name, f(q, k, v, cu, max_len, causal) -> out) of the installed torch's variable-length path."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        params = inspect.signature(varlen_attn).parameters

        def run(q, k, v, cu, m, causal):
            if "is_causal" in params:
                return varlen_attn(q, k, v, cu, cu, m, m, is_causal=causal)
            return varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0) if causal else (-1, -1))

        return "torch.nn.attention.varlen.varlen_attn", run

    def run_njt(q, k, v, cu, m, causal):
        off = cu.to(torch.int64)
        nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, off).transpose(1, 2) for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(nq, nk, nv, is_causal=causal)
        return out.transpose(1, 2).values()

    return "scaled_dot_product_attention on nested jagged tensors", run_njt


def median_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        t.append(a.elapsed_time(b))
    t.sort()
    return t[len(t) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kfa-bench", required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--reps", type=int, default=20)
    args, rest = ap.parse_known_args()
    cmd = [args.kfa_bench, "--dtype", args.dtype, "--d", str(args.d), "--hidden", str(args.hidden), "--causal",
           args.causal, "--reps", str(args.reps)] + rest
    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(res.stdout)
    if res.returncode != 0:
        sys.stderr.write(res.stderr)
        sys.exit(res.returncode)
    lengths, kfa = None, {}
    for line in res.stdout.splitlines():
        if line.startswith("lengths:"):
            lengths = [int(x) for x in line.split()[1:]]
        elif line and not line.startswith("#"):
            f = line.split()
            kfa[(f[0], int(f[3]))] = (float(f[8]), float(f[10]))
    heads = max(1, args.hidden // args.d)
    dt = DT[args.dtype]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    sum_sq = sum(float(l) * l for l in lengths)
    name, run = torch_varlen()
    print(f"# torch {torch.__version__}: {name}; {torch.cuda.get_device_name()}")
    print("| causal | kfa varlen fwd | kfa fixed fwd | torch varlen fwd | kfa/torch fwd | kfa varlen/fixed fwd "
          "| kfa varlen f+b | kfa fixed f+b | torch varlen f+b | kfa/torch f+b | kfa varlen/fixed f+b |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(11)
    for causal in [int(c) for c in args.causal.split(",")]:
        q, k, v, do = (torch.randn(total, heads, args.d, device="cuda", dtype=dt, generator=g) for _ in range(4))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        flops = 4.0 * heads * args.d * sum_sq * (0.5 if causal else 1.0)
        try:
            with torch.no_grad():
                t_f = median_ms(lambda: run(q, k, v, cu, longest, bool(causal)), args.reps)

            def fb():
                out = run(q, k, v, cu, longest, bool(causal))
                out.backward(do)

            t_fb = median_ms(fb, args.reps)
            tf, tfb = flops / t_f * 1e-9, 3.5 * flops / t_fb * 1e-9
        except Exception as e:  # the peer cannot run this case: say so, keep kfa's figures
            print(f"# torch failed (causal {causal}): {type(e).__name__}: {e}")
            tf = tfb = float("nan")
        kv, kf = kfa.get(("varlen", causal)), kfa.get(("fixed_equal_flops", causal)) or kfa.get(
            ("fixed_same_lengths", causal))
        print(f"| {causal} | {kv[0]:.1f} | {kf[0]:.1f} | {tf:.1f} | {kv[0] / tf:.3f} | {kv[0] / kf[0]:.3f} "
              f"| {kv[1]:.1f} | {kf[1]:.1f} | {tfb:.1f} | {kv[1] / tfb:.3f} | {kv[1] / kf[1]:.3f} |")
    print("TFLOP/s; fixed = kfa's fixed-length call (same lengths when all are equal, else equal FLOPs and tokens)")


if __name__ == "__main__":
    main()
