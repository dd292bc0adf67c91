#!/usr/bin/env python3
"""Side-by-side: kfa vs PyTorch SDPA (flash, cuDNN; memory-efficient for fp32) on one GPU, same inputs.

Runs perf/kfa_bench_sdpa (kfa's timings and 64 sampled rows of every output), regenerates the same q, k,
v, dO in torch from the counter hash both sides share, times torch's backends the same way (median of
CUDA-event-timed calls after a warm-up), and computes relative Frobenius errors of the sampled rows against
float64 for kfa, torch's flash backend and torch's math backend in the same dtype. Prints a markdown
table and writes it (and the raw rows as CSV) under --out. PyTorch is the yardstick here, never a
dependency of kfa.

  python3 perf/sdpa_compare.py --kfa-bench build/perf/kfa_bench_sdpa --out results/ [--n 512,...] [--d 64,128]
"""
import argparse
import csv
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def hash_tensor(shape, seed, dtype):
    """The counter hash of perf/bench_sdpa.cpp, bit for bit: uniform on [-sqrt(3), sqrt(3))."""
    n = math.prod(shape)
    i = torch.arange(n, device="cuda", dtype=torch.int64)
    h = (i * 2654435761 + seed * 97531) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    u = (h >> 8).to(torch.float32) * (1.0 / 8388608.0) - 1.0
    u = u * torch.tensor(1.7320508, dtype=torch.float32, device="cuda")
    return u.to(dtype).view(shape)


def sample_rows(n):
    return [(2 * s + 1) * n // 128 for s in range(64)]


def median_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def rel(x, ref):
    x = x.double()
    if not torch.isfinite(x).all():
        return float("nan")
    return ((x - ref).norm() / ref.norm()).item()


def ref_rows(q, k, v, do, rows, causal, nb):
    """float64 o rows and, when do is given, dq (those query rows), dk, dv (those key rows), batch < nb."""
    q64, k64, v64 = (t[:nb].double().transpose(1, 2) for t in (q, k, v))  # b h n d
    n, d = q64.shape[2], q64.shape[3]
    scale = 1.0 / math.sqrt(d)
    idx = torch.tensor(rows, device="cuda")
    if do is None:
        s = torch.matmul(q64[:, :, idx], k64.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.arange(n, device="cuda")[None, :] > idx[:, None], float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v64), None
    q64.requires_grad_(True), k64.requires_grad_(True), v64.requires_grad_(True)
    o = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    o.backward(do[:nb].double().transpose(1, 2))
    return o.detach()[:, :, idx], (q64.grad[:, :, idx], k64.grad[:, :, idx], v64.grad[:, :, idx])


def math_rows(q, k, v, rows, causal, nb):
    """torch's math backend in the input dtype, on the sampled query rows (explicit mask = causal)."""
    qs, ks, vs = (t[:nb].transpose(1, 2) for t in (q, k, v))
    n = ks.shape[2]
    idx = torch.tensor(rows, device="cuda")
    mask = None
    if causal:
        mask = torch.arange(n, device="cuda")[None, :] <= idx[:, None]
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(qs[:, :, idx], ks, vs, attn_mask=mask)


def read_rows(path, b, h, d):
    import numpy as np

    a = np.fromfile(path, dtype=np.float32).reshape(b, h, 64, d)
    return torch.from_numpy(a).cuda()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kfa-bench", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--grad-check-max-n", type=int, default=4096)
    ap.add_argument("--kfa-path", default="automatic")
    ap.add_argument("--kfa-nondeterministic", action="store_true",
                    help="kfa with AttentionOptions::deterministic = false (atomic dQ, as flash)")
    ap.add_argument("--rows", help="where the sampled output rows go (default OUT/rows)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows_dir = a.rows or os.path.join(a.out, "rows")
    os.makedirs(rows_dir, exist_ok=True)

    cmd = [a.kfa_bench, "--out", rows_dir, "--dtypes", a.dtypes, "--d", a.d, "--n", a.n, "--causal", a.causal,
           "--tokens", str(a.tokens), "--hidden", str(a.hidden), "--reps", str(a.reps), "--path", a.kfa_path]
    if a.kfa_nondeterministic:
        cmd.append("--nondeterministic")
    print("#", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        sys.exit(f"kfa_bench_sdpa failed with {res.returncode}")
    header = [l for l in res.stdout.splitlines() if l.startswith("#")]
    cases = [l.split() for l in res.stdout.splitlines() if l and not l.startswith("#")]

    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    out_rows = []
    for c in cases:
        dt, d, n, causal, b, h = c[0], int(c[1]), int(c[2]), int(c[3]) == 1, int(c[4]), int(c[5])
        seed = int(c[7].split("=")[1])
        kfa_f_ms, kfa_f_tf, kfa_fb_ms, kfa_fb_tf = (float(x) for x in c[8:12])
        dtype = DT[dt]
        q, k, v, do = (hash_tensor((b, n, h, d), seed + j, dtype) for j in (1, 2, 3, 4))
        fwd_flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
        backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
        if dt == "fp32":
            backends = [("efficient", SDPBackend.EFFICIENT_ATTENTION)]
        row = {"dtype": dt, "d": d, "N": n, "causal": int(causal), "batch": b, "heads": h,
               "kfa_fwd_tflops": kfa_f_tf, "kfa_fwdbwd_tflops": kfa_fb_tf}
        qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
        torch_o = {}
        for name, be in backends:
            try:
                with sdpa_kernel([be]):
                    f = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    torch_o[name] = f()
                    ms = median_ms(f, a.reps)
                    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (qt, kt, vt))

                    def fb():
                        qg.grad = kg.grad = vg.grad = None
                        F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(dot)

                    ms_fb = median_ms(fb, a.reps)
                row[f"{name}_fwd_tflops"] = fwd_flops / ms * 1e-9
                row[f"{name}_fwdbwd_tflops"] = 3.5 * fwd_flops / ms_fb * 1e-9
            except RuntimeError as e:
                print(f"# {name} unavailable for {dt} d={d} N={n}: {str(e).splitlines()[0]}", flush=True)
                row[f"{name}_fwd_tflops"] = row[f"{name}_fwdbwd_tflops"] = float("nan")

        # errors on the sampled rows of the first batch elements, against float64
        nb = min(b, 2)
        rows = sample_rows(n)
        grads = n <= a.grad_check_max_n
        oref, gref = ref_rows(q, k, v, do if grads else None, rows, causal, nb)
        stem = os.path.join(rows_dir, f"kfa_{dt}_d{d}_n{n}_c{int(causal)}")
        ko = read_rows(stem + "_o.f32", b, h, d)[:nb]
        row["err_kfa_o"] = rel(ko, oref)
        row["err_math_o"] = rel(math_rows(q, k, v, rows, causal, nb), oref)
        first = backends[0][0]
        if first in torch_o:
            row[f"err_{first}_o"] = rel(torch_o[first][:nb][:, :, torch.tensor(rows, device="cuda")], oref)
        if grads and os.path.exists(stem + "_dq.f32"):
            kg = [read_rows(stem + f"_{g}.f32", b, h, d)[:nb] for g in ("dq", "dk", "dv")]
            row["err_kfa_grad"] = max(rel(x, r) for x, r in zip(kg, gref))
            qm, km, vm = (x[:nb].transpose(1, 2).detach().clone().requires_grad_(True) for x in (q, k, v))
            with sdpa_kernel([SDPBackend.MATH]):
                F.scaled_dot_product_attention(qm, km, vm, is_causal=causal).backward(do[:nb].transpose(1, 2))
            idx = torch.tensor(rows, device="cuda")
            row["err_math_grad"] = max(rel(x.grad[:, :, idx], r) for x, r in zip((qm, km, vm), gref))
            if first in torch_o:  # flash's (fp32: memory-efficient's) gradients, the issue-12 yardstick
                qf, kf, vf = (x[:nb].transpose(1, 2).detach().clone().requires_grad_(True) for x in (q, k, v))
                with sdpa_kernel([backends[0][1]]):
                    F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).backward(do[:nb].transpose(1, 2))
                row[f"err_{first}_grad"] = max(rel(x.grad[:, :, idx], r) for x, r in zip((qf, kf, vf), gref))
        out_rows.append(row)
        print("#row", row, flush=True)
        del q, k, v, do, qt, kt, vt, dot, torch_o
        torch.cuda.empty_cache()

    keys = sorted({k for r in out_rows for k in r}, key=lambda k: list(out_rows[0]).index(k) if k in out_rows[0] else 99)
    with open(os.path.join(a.out, "sdpa_compare.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(out_rows)

    def g(r, k, fmt="{:.1f}"):
        x = r.get(k)
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)

    lines = header + [f"# torch {torch.__version__}, {torch.cuda.get_device_name()}", "",
                      "| dtype | d | N | causal | kfa fwd | flash/eff fwd | cudnn fwd | kfa/flash fwd | kfa f+b | flash/eff f+b | cudnn f+b | kfa/flash f+b | err kfa o | err math o | err flash o | err kfa grad | err math grad | err flash/eff grad | kfa/math err | kfa/flash err |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out_rows:
        ref = "efficient" if r["dtype"] == "fp32" else "flash"
        ff, fb = r.get(f"{ref}_fwd_tflops", float("nan")), r.get(f"{ref}_fwdbwd_tflops", float("nan"))
        ratio_err = max(r.get("err_kfa_o", 0) / max(r.get("err_math_o", 1e-30), 1e-30),
                        r.get("err_kfa_grad", 0) / max(r.get("err_math_grad", 1e-30), 1e-30) if "err_kfa_grad" in r else 0)
        # kfa's error over flash's (fp32: memory-efficient's), the larger of o's and the gradients' (issue 12: <= 1.2)
        ratio_ref = max(r.get("err_kfa_o", 0) / max(r.get(f"err_{ref}_o", 1e-30), 1e-30),
                        r.get("err_kfa_grad", 0) / max(r.get(f"err_{ref}_grad", 1e-30), 1e-30)
                        if f"err_{ref}_grad" in r else 0)
        lines.append(
            f"| {r['dtype']} | {r['d']} | {r['N']} | {'yes' if r['causal'] else 'no'} | {g(r, 'kfa_fwd_tflops')} | "
            f"{g(r, ref + '_fwd_tflops')} | {g(r, 'cudnn_fwd_tflops')} | {r['kfa_fwd_tflops'] / ff:.2f} | "
            f"{g(r, 'kfa_fwdbwd_tflops')} | {g(r, ref + '_fwdbwd_tflops')} | {g(r, 'cudnn_fwdbwd_tflops')} | "
            f"{r['kfa_fwdbwd_tflops'] / fb:.2f} | {g(r, 'err_kfa_o', '{:.2e}')} | {g(r, 'err_math_o', '{:.2e}')} | "
            f"{g(r, 'err_' + ref + '_o', '{:.2e}')} | {g(r, 'err_kfa_grad', '{:.2e}')} | {g(r, 'err_math_grad', '{:.2e}')} | "
            f"{g(r, 'err_' + ref + '_grad', '{:.2e}')} | {ratio_err:.2f} | "
            f"{ratio_ref if f'err_{ref}_o' in r else float('nan'):.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "sdpa_compare.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
