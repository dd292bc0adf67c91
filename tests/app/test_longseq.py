#!/usr/bin/env python3
"""End-to-end tests of kfa-longseq: HDF5 files written by h5py (float16/32/64), results against a numpy
float64 reference, rank-count independence of --generate, bad inputs, and never a partial output file.

  test_longseq.py APP MPIEXEC [MPIEXEC flags...]
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

APP = sys.argv[1]
MPI = sys.argv[2:]
FAILURES = []


def run(np_, *args, timeout=300):
    cmd = MPI[:1] + ["-n", str(np_)] + MPI[1:] + [APP] + [str(a) for a in args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)


def reference(q, k, v, do, causal, window=(-1, -1), scale=None, softcap=0.0):
    """float64 attention forward and gradients from the definition; q [B,S,H,D], k/v [B,S,Hkv,D]."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    b, s, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    scale = scale or 1.0 / np.sqrt(d)
    kk = np.repeat(k, g, axis=2)
    vv = np.repeat(v, g, axis=2)
    sc = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    t = None
    if softcap > 0:
        t = np.tanh(sc / softcap)
        sc = softcap * t
    i = np.arange(s)[:, None]
    j = np.arange(s)[None, :]
    vis = np.ones((s, s), bool)
    if causal:
        vis &= j <= i
    if window[1] >= 0:
        vis &= j <= i + window[1]
    if window[0] >= 0:
        vis &= j >= i - window[0]
    sc = np.where(vis, sc, -np.inf)
    m = sc.max(-1, keepdims=True)
    p = np.exp(sc - m)
    l = p.sum(-1, keepdims=True)
    p /= l
    o = np.einsum("bhij,bjhd->bihd", p, vv)
    lse = (m + np.log(l))[..., 0]
    dp = np.einsum("bihd,bjhd->bhij", do, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    if t is not None:
        ds *= 1 - t * t
    dq = np.einsum("bhij,bjhd->bihd", ds, kk) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q).reshape(b, s, hkv, g, d).sum(3) * scale
    dv = np.einsum("bhij,bihd->bjhd", p, do).reshape(b, s, hkv, g, d).sum(3)
    return o, lse, dq, dk, dv


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return np.inf
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def main():
    tmp = tempfile.mkdtemp(prefix="kfa_app_")
    rng = np.random.default_rng()
    b, s, h, hkv, d = 1, 203, 4, 2, 32
    for dtype in (np.float16, np.float32, np.float64):
        q = rng.standard_normal((b, s, h, d)).astype(dtype)
        k = rng.standard_normal((b, s, hkv, d)).astype(dtype)
        v = rng.standard_normal((b, s, hkv, d)).astype(dtype)
        do = rng.standard_normal((b, s, h, d)).astype(dtype)
        inp = os.path.join(tmp, f"in_{np.dtype(dtype).name}.h5")
        with h5py.File(inp, "w") as f:
            for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
                f[name] = x
        compute = "float64" if dtype == np.float64 else "float32"
        tol = 1e-12 if compute == "float64" else 1e-5
        o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, do, causal=True, window=(40, -1))
        for nranks, layout in ((1, "contiguous"), (2, "zigzag"), (3, "contiguous")):
            out = os.path.join(tmp, f"out_{np.dtype(dtype).name}_{nranks}.h5")
            js = out + ".json"
            rc, log = run(nranks, "--input", inp, "--output", out, "--dtype", compute, "--causal", "--window", 40, -1,
                          "--layout", layout, "--backward", "--check", 3, "--json", js)
            tag = f"{np.dtype(dtype).name} input, {compute}, {nranks} ranks, {layout}"
            check(rc == 0, f"{tag}: exit 0 ({log.strip().splitlines()[-1] if log.strip() else ''})")
            if rc != 0:
                print(log)
                continue
            with h5py.File(out, "r") as f:
                check(f["o"].shape == (b, s, h, d) and f["lse"].shape == (b, h, s), f"{tag}: output shapes")
                check(f["o"].dtype == (np.float64 if compute == "float64" else np.float32), f"{tag}: o dtype")
                check(f.attrs["ranks"] == str(nranks).encode() or f.attrs["ranks"] == str(nranks), f"{tag}: ranks attribute")
                check(rel(f["o"][...], o_ref) <= tol, f"{tag}: o error {rel(f['o'][...], o_ref):.2e} <= {tol}")
                check(rel(f["lse"][...], lse_ref) <= tol, f"{tag}: lse error {rel(f['lse'][...], lse_ref):.2e}")
                for name, ref in (("dq", dq_ref), ("dk", dk_ref), ("dv", dv_ref)):
                    e = rel(f[name][...], ref)
                    check(e <= tol, f"{tag}: {name} error {e:.2e} <= {tol}")
            with open(js) as f:
                summary = json.load(f)
            check(summary["check_pass"] and summary["ranks"] == nranks, f"{tag}: JSON summary")
            check(not [x for x in os.listdir(tmp) if ".tmp-" in x], f"{tag}: no temporary file left")

    # --generate gives the same tensors for any rank count: outputs agree to fp32 rounding.
    outs = []
    for nranks, layout in ((1, "contiguous"), (2, "zigzag"), (4, "contiguous")):
        out = os.path.join(tmp, f"gen_{nranks}.h5")
        rc, log = run(nranks, "--generate", "--seqlen", 300, "--heads", 2, "--head-dim", 16, "--causal", "--layout",
                      layout, "--output", out, "--check", 2)
        check(rc == 0, f"--generate on {nranks} ranks: exit 0")
        if rc == 0:
            with h5py.File(out, "r") as f:
                outs.append(f["o"][...])
    if len(outs) == 3:
        check(rel(outs[1], outs[0]) < 1e-5 and rel(outs[2], outs[0]) < 1e-5, "--generate: 1, 2, 4 ranks agree")

    # Bad input: one clear message, non-zero exit, no output file.
    good = os.path.join(tmp, "in_float32.h5")
    bad_rank = os.path.join(tmp, "bad_rank.h5")
    with h5py.File(bad_rank, "w") as f:
        f["q"] = np.zeros((4, 8, 8), np.float32)
        f["k"] = np.zeros((1, 4, 8, 8), np.float32)
        f["v"] = np.zeros((1, 4, 8, 8), np.float32)
    no_v = os.path.join(tmp, "no_v.h5")
    with h5py.File(no_v, "w") as f:
        f["q"] = np.ones((1, 8, 2, 8), np.float32)
        f["k"] = np.ones((1, 8, 2, 8), np.float32)
    heads = os.path.join(tmp, "heads.h5")
    with h5py.File(heads, "w") as f:
        f["q"] = np.ones((1, 8, 3, 8), np.float32)
        f["k"] = np.ones((1, 8, 2, 8), np.float32)
        f["v"] = np.ones((1, 8, 2, 8), np.float32)
    ints = os.path.join(tmp, "ints.h5")
    with h5py.File(ints, "w") as f:
        for n in "qkv":
            f[n] = np.ones((1, 8, 2, 8), np.int32)
    out = os.path.join(tmp, "bad_out.h5")
    cases = [
        (("--input", os.path.join(tmp, "missing.h5")), "missing.h5"),
        (("--input", no_v), "no dataset 'v'"),
        (("--input", bad_rank), "rank 3"),
        (("--input", heads), "not a multiple of kv-heads"),
        (("--input", ints), "not float64, float32 or float16"),
        (("--generate", "--head-dim", 12), "head_dim = 12"),
        (("--generate", "--seqlen", 1), "shorter than the 2 ranks"),
        (("--generate", "--input", good), "excludes"),
        (("--generate", "--window", -3, 0), "--window"),
        (("--generate", "--layout", "spiral"), "--layout"),
        ((), "--input FILE or --generate"),
    ]
    for args, frag in cases:
        rc, log = run(2, *args, "--output", out)
        check(rc != 0 and frag in log and not os.path.exists(out), f"bad input {args}: exit {rc}, says '{frag}'")
    rc, log = run(2, "--generate", "--seqlen", 64, "--output", "/nonexistent_dir/out.h5")
    check(rc != 0 and "not writable" in log, "unwritable output directory")

    # A failed or killed run never replaces a good output file, and never leaves a partial one.
    keep = os.path.join(tmp, "keep.h5")
    rc, _ = run(2, "--generate", "--seqlen", 128, "--heads", 2, "--head-dim", 16, "--output", keep)
    before = open(keep, "rb").read() if rc == 0 else b""
    rc2, _ = run(2, "--input", no_v, "--output", keep)
    check(rc == 0 and rc2 != 0 and open(keep, "rb").read() == before, "failed run leaves the existing output intact")
    killed = os.path.join(tmp, "killed.h5")
    cmd = MPI[:1] + ["-n", "2"] + MPI[1:] + [APP, "--generate", "--seqlen", "262144", "--heads", "8", "--head-dim",
                                             "64", "--output", killed]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(3)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    check(not os.path.exists(killed), "killed run leaves no output file")

    print(f"{len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
