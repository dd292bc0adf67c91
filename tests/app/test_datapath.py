#!/usr/bin/env python3
"""kfa-longseq's data path (issue 11): inputs generated on the device in the compute dtype are the documented
counter hash (regenerated here in numpy) for any rank count and layout; --input is read straight into the
compute dtype, block by block; --output-dtype stores o, dq, dk, dv as float16/32/64 (rounded to nearest, as
numpy rounds); the report and the JSON give the host memory peak against the rank's tensors, and it stays
within 1.5x of them where no ring buffers are needed (one rank).

  test_datapath.py APP MPIEXEC [MPIEXEC flags...]
"""
import json
import os
import shutil
import sys
import tempfile

import h5py
import numpy as np

import apptest

APP = sys.argv[1]
MPI = sys.argv[2:]
check = apptest.check


def run(np_, *args, **kw):
    """Runs the app on np_ ranks (apptest.run_app: a hang is killed and returns 124)."""
    return apptest.run_app(MPI, APP, np_, *args, **kw)


generated = apptest.generated


def reference(q, k, v, do, causal):
    """apptest.reference as a dict: o, lse, dq, dk, dv."""
    return dict(zip(("o", "lse", "dq", "dk", "dv"), apptest.reference(q, k, v, do, causal)))


def max_err(a, b):
    a = np.asarray(a, np.float64)
    return float(np.max(np.abs(a - b))) if np.all(np.isfinite(a)) else np.inf


def read(path):
    with h5py.File(path, "r") as f:
        return {n: f[n][...] for n in f}, {n: f[n].dtype for n in f}, dict(f.attrs)


def generated_inputs(tmp):
    """--generate: the tensors are the hash for P = 1, 2, 3 and both layouts, rounded to the compute dtype;
    the results match a float64 numpy reference from the regenerated tensors element by element, and agree
    bitwise with a run on the same tensors written to a file (--input)."""
    b, s, h, hkv, d, seed = 2, 160, 4, 2, 16, 7
    shape_q, shape_k = (b, s, h, d), (b, s, hkv, d)
    ins = {n: generated(seed, i, shp) for n, i, shp in (("q", 0, shape_q), ("k", 1, shape_k), ("v", 2, shape_k),
                                                         ("do", 3, shape_q))}
    for dtype, tol in (("float32", 1e-5), ("float64", 1e-13)):
        x = {n: a.astype(dtype) for n, a in ins.items()}
        ref = reference(x["q"], x["k"], x["v"], x["do"], causal=True)
        runs = {}
        for np_, layout in ((1, "contiguous"), (2, "contiguous"), (2, "zigzag"), (3, "zigzag")):
            out = os.path.join(tmp, f"gen_{dtype}_{np_}_{layout}.h5")
            rc, log = run(np_, "--generate", "--batch", b, "--seqlen", s, "--heads", h, "--kv-heads", hkv,
                          "--head-dim", d, "--seed", seed, "--dtype", dtype, "--causal", "--layout", layout,
                          "--backward", "--check", 3, "--output", out, "--output-dtype", "float64")
            tag = f"--generate {dtype}, P={np_} {layout}"
            if rc != 0:
                check(False, f"{tag}: exit {rc}")
                print(log)
                continue
            got, _, _ = read(out)
            worst = max(max_err(got[n], ref[n]) / max(1.0, float(np.max(np.abs(ref[n]))))
                        for n in ("o", "lse", "dq", "dk", "dv"))
            check(worst <= tol, f"{tag}: o, lse, dq, dk, dv within {tol:g} (of max(1, max |x|)) of float64 numpy on "
                                f"the regenerated tensors, element by element (worst {worst:.2e})")
            check("generated on the device in" in log,
                  f"{tag}: the report says the inputs were generated on the device")
            runs[(np_, layout)] = got
        # The same tensors from a file: bitwise the same results (same inputs, same computation).
        inp = os.path.join(tmp, f"gen_as_file_{dtype}.h5")
        with h5py.File(inp, "w") as f:
            for n, a in x.items():
                f[n] = a
        for np_, layout in ((1, "contiguous"), (2, "zigzag")):
            out = os.path.join(tmp, f"file_{dtype}_{np_}.h5")
            rc, log = run(np_, "--input", inp, "--dtype", dtype, "--causal", "--layout", layout, "--backward",
                          "--check", 3, "--output", out, "--output-dtype", "float64")
            same = False
            if rc == 0 and (np_, layout) in runs:
                got, _, _ = read(out)
                same = all(np.array_equal(got[n], runs[(np_, layout)][n]) for n in ("o", "lse", "dq", "dk", "dv"))
            check(same, f"--input of the regenerated {dtype} tensors, P={np_} {layout}: bitwise the results of "
                        f"--generate (exit {rc})")
            if rc != 0:
                print(log)


def output_dtypes(tmp):
    """--output-dtype float16/float32/float64: the stored types (lse float64 only with float64), the
    attribute and the JSON say it; float16 is numpy's round-to-nearest of the float32 results (65520 and up
    become Inf); the default is the compute dtype; refused without --output and for other names."""
    gen = ("--generate", "--seqlen", 96, "--heads", 2, "--head-dim", 16, "--causal", "--backward")
    full = {}
    for compute, out_dtype, want in (("float32", None, np.float32), ("float64", None, np.float64),
                                     ("float32", "float64", np.float64), ("float32", "float16", np.float16),
                                     ("float64", "float32", np.float32), ("float64", "float16", np.float16)):
        out = os.path.join(tmp, f"odt_{compute}_{out_dtype}.h5")
        js = out + ".json"
        extra = ("--output-dtype", out_dtype) if out_dtype else ()
        rc, log = run(2, *gen, "--dtype", compute, "--output", out, "--json", js, *extra)
        tag = f"--dtype {compute} --output-dtype {out_dtype or '(default)'}"
        if rc != 0:
            check(False, f"{tag}: exit {rc}")
            print(log)
            continue
        got, types, attrs = read(out)
        rep = json.load(open(js))
        lse_want = np.float64 if want == np.float64 else np.float32
        ok = all(types[n] == want for n in ("o", "dq", "dk", "dv")) and types["lse"] == lse_want
        name = np.dtype(want).name
        check(ok and attrs.get("output_dtype") == name and rep.get("output_dtype") == name,
              f"{tag}: o, dq, dk, dv stored as {name}, lse as {np.dtype(lse_want).name}, attribute and JSON say "
              f"{name} ({ {n: str(t) for n, t in types.items()} })")
        if want == np.float64:
            full[compute] = got
        elif compute in full and (out_dtype or compute) != compute:
            exact = all(np.array_equal(got[n], full[compute][n].astype(want)) for n in ("o", "dq", "dk", "dv"))
            check(exact, f"{tag}: the {name} values are numpy's round-to-nearest of the {compute} results")
    rc, log = run(1, *gen, "--output-dtype", "float16")
    check(rc == 2 and "--output-dtype needs --output" in log, f"--output-dtype without --output: exit {rc} (want 2)")
    rc, log = run(1, *gen, "--output", os.path.join(tmp, "x.h5"), "--output-dtype", "bfloat16")
    check(rc == 2 and "--output-dtype" in log, f"--output-dtype bfloat16 (no HDF5 type): exit {rc} (want 2)")
    # Rounding to float16 is to nearest (numpy's), not HDF5's own conversion (which truncates: 65521 -> 65504):
    # q = k = 0 makes every o row the (identical) v row.
    vals = np.array([65519.0, 65521.0, -65530.0, 2049.9, 0.1, 1e-8, 3.0e-5, -2.0], np.float32)
    inp = os.path.join(tmp, "big_v.h5")
    z = np.zeros((1, 8, 1, 8), np.float32)
    with h5py.File(inp, "w") as f:
        f["q"], f["k"], f["v"] = z, z, np.broadcast_to(vals, (1, 8, 1, 8)).copy()
    got = {}
    for od in ("float32", "float16"):
        out = os.path.join(tmp, f"big_o_{od}.h5")
        rc, log = run(1, "--input", inp, "--output", out, "--output-dtype", od)
        got[od] = read(out)[0]["o"] if rc == 0 else None
        if rc != 0:
            print(log)
    ok = got["float32"] is not None and got["float16"] is not None
    if ok:
        with np.errstate(over="ignore"):
            ok = np.array_equal(got["float16"], got["float32"].astype(np.float16))
        ok = ok and np.isposinf(got["float16"][0, :, 0, 1]).all() and np.isneginf(got["float16"][0, :, 0, 2]).all()
        ok = ok and (got["float16"][0, :, 0, 0] == 65504).all() and (got["float16"][0, :, 0, 3] == 2050).all()
    check(ok, "float16 output rounds to nearest as numpy: 65519 -> 65504, 65521 -> inf, -65530 -> -inf, "
              "2049.9 -> 2050, subnormals kept")


def read_in_compute_dtype(tmp):
    """--input in float16/32/64 is read straight into the compute dtype (HDF5 converts, rounding to nearest)
    block by block: the results equal those of the inputs rounded by numpy first; blocks of a few elements
    (KFA_LONGSEQ_IO_CHUNK, unequal block counts per rank: batch 3, P=3 zigzag) change nothing, bitwise, for
    reading and writing."""
    rng = np.random.default_rng(3)
    b, s, h, d = 3, 70, 2, 8
    raw = {n: rng.standard_normal((b, s, h, d)) * 3 for n in ("q", "k", "v", "do")}
    for file_dtype in (np.float64, np.float32, np.float16):
        inp = os.path.join(tmp, f"in_{np.dtype(file_dtype).name}.h5")
        with h5py.File(inp, "w") as f:
            for n, a in raw.items():
                f[n] = a.astype(file_dtype)
        for compute in ("float32", "float64"):
            stored = {n: a.astype(file_dtype) for n, a in raw.items()}
            x = {n: a.astype(compute) for n, a in stored.items()}  # what the app must compute with
            ref = reference(x["q"], x["k"], x["v"], x["do"], causal=False)
            outs = []
            for chunk in (None, "37"):
                out = os.path.join(tmp, f"rt_{np.dtype(file_dtype).name}_{compute}_{chunk}.h5")
                rc, log = run(3, "--input", inp, "--dtype", compute, "--layout", "zigzag", "--backward", "--check", 2,
                              "--output", out, "--output-dtype", "float64",
                              env={"KFA_LONGSEQ_IO_CHUNK": chunk} if chunk else None)
                tag = (f"{np.dtype(file_dtype).name} file, --dtype {compute}, P=3"
                       f"{', blocks of 37 elements' if chunk else ''}")
                if rc != 0:
                    check(False, f"{tag}: exit {rc}")
                    print(log)
                    continue
                got = read(out)[0]
                outs.append(got)
                tol = 1e-12 if compute == "float64" else 2e-5
                worst = max(max_err(got[n], ref[n]) / max(1.0, float(np.max(np.abs(ref[n]))))
                            for n in ("o", "dq", "dk", "dv"))
                check(worst <= tol, f"{tag}: results of the inputs rounded to {compute} (worst {worst:.1e} <= {tol:g})")
            if len(outs) == 2:
                check(all(np.array_equal(outs[0][n], outs[1][n]) for n in outs[0]),
                      f"{np.dtype(file_dtype).name} file, --dtype {compute}: blocks of 37 elements give bitwise "
                      "the same output")
    # float64 values beyond float32's range become Inf in float32 (refused as input), as before.
    huge = os.path.join(tmp, "huge.h5")
    with h5py.File(huge, "w") as f:
        q = raw["q"].copy()
        q[1, 5, 1, 3] = -1e300
        f["q"], f["k"], f["v"] = q, raw["k"], raw["v"]
    rc, log = run(2, "--input", huge, "--dtype", "float32", env={"KFA_LONGSEQ_IO_CHUNK": "50"})
    check(rc == 2 and "'q'" in log and "[1, 5, 1, 3]" in log,
          f"-1e300 read into float32 is -Inf, refused naming [1, 5, 1, 3] (exit {rc})")


def host_memory(tmp):
    """The report and the JSON give the host memory peak (VmHWM) and its ratio to the rank's tensors in the
    compute dtype; with one rank (no ring buffers) it stays within 1.5x of them for generated inputs and for
    --input with --backward --check --output (c8edcdf held every input as float64 on the host too: ~3x)."""
    # 64 MiB per float32 tensor: large against the libraries' own ~30 MiB, as the 1.5x bound needs. Under sanitizers,
    # where no bound is checked (below), a quarter of it: the report is checked the same way.
    sanitized = bool(os.environ.get("KFA_TEST_SANITIZED"))
    s, h, d = 16384 if sanitized else 65536, 4, 64
    inp = os.path.join(tmp, "mem_in.h5")
    rng = np.random.default_rng(1)
    with h5py.File(inp, "w") as f:
        for n in ("q", "k", "v", "do"):
            f[n] = rng.standard_normal((1, s, h, d), dtype=np.float32)  # float32 draws: 3x faster than a cast
    window = ("--causal", "--window", 63, 0)  # little compute: the data path is what is measured
    cases = [
        ("generated, forward, --check 2", 1,
         ("--generate", "--seqlen", s, "--heads", h, "--head-dim", d, "--check", 2), 1.5),
        ("--input, --backward --check 2 --output", 1,
         ("--input", inp, "--backward", "--check", 2, "--output", os.path.join(tmp, "mem_out.h5")), 1.5),
        # No bound: a quarter of the tokens per rank (5x faster) reports the same way.
        ("generated, forward+backward, P=2 (ring buffers on this host backend)", 2,
         ("--generate", "--seqlen", s // 2, "--heads", h, "--head-dim", d, "--backward", "--check", 2), None),
    ]
    for what, np_, args, bound in cases:
        js = os.path.join(tmp, "mem.json")
        rc, log = run(np_, *args, *window, "--json", js, timeout=600)
        rep = json.load(open(js)) if rc == 0 else {}
        peak, tens, ratio = rep.get("host_memory_peak_mib"), rep.get("tensor_mib"), rep.get("host_memory_ratio")
        sane = (isinstance(peak, (int, float)) and isinstance(tens, (int, float)) and isinstance(ratio, (int, float))
                and tens > 0 and abs(ratio - peak / tens) < 0.05 * ratio and "host memory peak" in log)
        if rep.get("tensors_on_host"):
            sane = sane and peak >= tens  # the tensors are host memory here
        check(rc == 0 and sane, f"host memory, {what}: reported in the report and the JSON (peak {peak} MiB, "
                                f"tensors {tens} MiB, ratio {ratio})")
        if bound is not None and sane and sanitized:
            # AddressSanitizer's shadow memory and quarantine inflate the peak (1.69x seen for a 1.2x run)
            print(f"note: host memory, {what}: peak {ratio:.2f}x the rank's tensors; not bounded under sanitizers")
        elif bound is not None and sane:
            check(ratio <= bound, f"host memory, {what}: peak {ratio:.2f}x the rank's tensors (<= {bound})")
        if rc != 0:
            print(log)


def main():
    tmp = tempfile.mkdtemp(prefix="kfa_datapath_")
    try:
        generated_inputs(tmp)
        output_dtypes(tmp)
        read_in_compute_dtype(tmp)
        host_memory(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return apptest.finish()


if __name__ == "__main__":
    sys.exit(main())
