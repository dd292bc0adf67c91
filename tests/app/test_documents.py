#!/usr/bin/env python3
"""kfa-longseq with documents packed into the sequence (variable-length batches): --doc-lengths and
--doc-lognormal with --generate, a 'cu_seqlens' dataset (int32 or int64, written here by h5py) with --input. The
results equal float64 numpy applied to each document alone (no token sees another document's), for several
rank counts, layouts and strategies (ring, Ulysses, hybrid); a file with the same tensors and cu_seqlens gives
bitwise the same results; --check checks rows of several documents; bad documents are refused with a message and
exit 2.

  test_documents.py APP MPIEXEC [MPIEXEC flags...]
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


def read(path):
    with h5py.File(path, "r") as f:
        return {n: f[n][...] for n in ("o", "lse", "dq", "dk", "dv") if n in f}


def reference_documents(x, cu, causal):
    """float64 attention of each document alone, assembled: o, lse, dq, dk, dv of the whole [1, S, ...] sequence."""
    out = {"o": np.zeros_like(x["q"]), "dq": np.zeros_like(x["q"]), "dk": np.zeros_like(x["k"]),
           "dv": np.zeros_like(x["k"]), "lse": np.zeros((1, x["q"].shape[2], x["q"].shape[1]))}
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        o, lse, dq, dk, dv = apptest.reference(*(x[n][:, a:b] for n in ("q", "k", "v", "do")), causal)
        out["o"][:, a:b], out["dq"][:, a:b], out["dk"][:, a:b], out["dv"][:, a:b] = o, dq, dk, dv
        out["lse"][:, :, a:b] = lse
    return out


def documents_end_to_end(tmp):
    lengths, h, hkv, d, seed = [37, 0, 90, 5, 28], 4, 2, 16, 5
    s = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    x = {n: apptest.generated(seed, i, (1, s, hh, d)).astype("float64")
         for n, i, hh in (("q", 0, h), ("k", 1, hkv), ("v", 2, hkv), ("do", 3, h))}
    ref = reference_documents(x, cu, causal=True)
    runs = {}
    # the ring, Ulysses (every document whole on each rank between the all-to-alls) and the hybrid
    for np_, layout, sp in ((1, "contiguous", []), (2, "zigzag", []), (3, "contiguous", []), (3, "zigzag", []),
                            (2, "zigzag", ["--sp", "ulysses"]), (4, "contiguous", ["--sp", "ulysses"]),
                            (4, "zigzag", ["--sp", "hybrid", "--ulysses-degree", 2]),
                            (4, "contiguous", ["--sp", "hybrid", "--ulysses-degree", 2])):
        name = "_".join(map(str, [np_, layout] + sp[1::2]))
        out = os.path.join(tmp, f"docs_{name}.h5")
        js = os.path.join(tmp, f"docs_{name}.json")
        rc, log = run(np_, "--generate", "--doc-lengths", ",".join(map(str, lengths)), "--heads", h, "--kv-heads",
                      hkv, "--head-dim", d, "--seed", seed, "--dtype", "float64", "--causal", "--layout", layout,
                      "--backward", "--check", 4, "--output", out, "--json", js, *sp)
        tag = f"--doc-lengths {lengths}, P={np_} {layout} {' '.join(map(str, sp))}"
        if rc != 0:
            check(False, f"{tag}: exit {rc}")
            print(log)
            continue
        got = read(out)
        worst = max(float(np.max(np.abs(got[n] - ref[n]))) / max(1.0, float(np.max(np.abs(ref[n]))))
                    for n in ("o", "lse", "dq", "dk", "dv"))
        check(worst <= 1e-12, f"{tag}: o, lse, dq, dk, dv equal float64 numpy on each document alone within 1e-12 "
                              f"(worst {worst:.2e})")
        check("documents: 5 packed in 160 tokens, longest 90" in log, f"{tag}: the report gives the documents")
        with h5py.File(out, "r") as f:
            cu_out = f["cu_seqlens"][...] if "cu_seqlens" in f else None
        check(cu_out is not None and cu_out.dtype == np.int64 and np.array_equal(cu_out, cu),
              f"{tag}: the output holds cu_seqlens (int64) equal to the documents' (got {cu_out})")
        with open(js) as f:
            summary = json.load(f)
        check(summary.get("documents") == 5 and summary.get("longest_document") == 90,
              f"{tag}: the JSON summary gives documents 5, longest 90 (got {summary.get('documents')}, "
              f"{summary.get('longest_document')})")
        kind = sp[1] if sp else "ring"
        check(summary.get("sp") == kind and (summary.get("a2a_bytes", 0) > 0) == bool(sp),
              f"{tag}: the JSON names the strategy ({summary.get('sp')}) and its all-to-all bytes")
        if not sp:
            runs[np_] = got
    # Without documents the same tensors give other results (the documents are really applied).
    out = os.path.join(tmp, "one_sequence.h5")
    rc, log = run(1, "--generate", "--seqlen", s, "--heads", h, "--kv-heads", hkv, "--head-dim", d, "--seed", seed,
                  "--dtype", "float64", "--causal", "--output", out)
    check(rc == 0 and not np.allclose(read(out)["o"], ref["o"]), "one sequence of the same tensors differs")
    # The same tensors and cu_seqlens from a file (int32 and int64): bitwise the generated run's results.
    for cu_type in ("int32", "int64"):
        inp = os.path.join(tmp, f"docs_in_{cu_type}.h5")
        with h5py.File(inp, "w") as f:
            for n, a in x.items():
                f[n] = a
            f["cu_seqlens"] = cu.astype(cu_type)
        out = os.path.join(tmp, f"docs_file_{cu_type}.h5")
        rc, log = run(2, "--input", inp, "--dtype", "float64", "--causal", "--layout", "zigzag", "--backward",
                      "--check", 4, "--output", out)
        same = rc == 0 and 2 in runs and all(np.array_equal(read(out)[n], runs[2][n]) for n in runs[2])
        check(same, f"--input with {cu_type} cu_seqlens, P=2 zigzag: bitwise the --generate run's results (exit {rc})")
        if rc != 0:
            print(log)
    # --check fails on a wrong result with documents too.
    rc, log = run(2, "--generate", "--doc-lengths", ",".join(map(str, lengths)), "--heads", h, "--kv-heads", hkv,
                  "--head-dim", d, "--causal", "--check", 8)
    check(rc == 0, f"--check 8 rows over the documents passes (exit {rc})")
    # A log-normal mix.
    rc, log = run(2, "--generate", "--doc-lognormal", 40, 0.8, 8, 100, 3, "--seqlen", 400, "--heads", 2,
                  "--head-dim", 16, "--causal", "--layout", "zigzag", "--backward", "--check", 6)
    check(rc == 0 and "documents: " in log and "packed in 400 tokens" in log,
          f"--doc-lognormal 40 0.8 8 100 3 --seqlen 400 runs and checks (exit {rc})")
    if rc != 0:
        print(log)


def refusals(tmp):
    base = ["--heads", 2, "--head-dim", 16]
    cases = [
        (["--generate", "--doc-lengths", "10,20", "--seqlen", 40] + base, "--doc-lengths add up to 30 tokens but "
                                                                         "--seqlen is 40"),
        (["--generate", "--doc-lengths", "10,20", "--batch", 2] + base, "batch must be 1, not 2"),
        (["--generate", "--doc-lengths", "10,20", "--doc-lognormal", 10, 1, 1, 20, 1] + base,
         "--doc-lengths and --doc-lognormal exclude each other"),
        (["--generate", "--doc-lognormal", 10, 1, 30, 20, 1] + base, "--doc-lognormal MEDIAN SIGMA MIN MAX SEED needs"),
    ]
    x = {n: apptest.generated(1, i, (1, 30, 2, 16)) for n, i in (("q", 0), ("k", 1), ("v", 2))}
    for name, cu in (("decreasing", [0, 20, 10, 30]), ("short", [0, 10, 25]), ("float", [0.0, 30.0])):
        inp = os.path.join(tmp, f"bad_cu_{name}.h5")
        with h5py.File(inp, "w") as f:
            for n, a in x.items():
                f[n] = a
            f["cu_seqlens"] = np.array(cu, dtype="float32" if name == "float" else "int32")
        want = {"decreasing": "decreases: entry 2 = 10 < entry 1 = 20",
                "short": "ends at 25 but the sequence has 30 tokens",
                "float": "has type float32; expected an integer type"}[name]
        cases.append((["--input", inp], want))
    for args, want in cases:
        for np_ in (1, 2):
            rc, log = run(np_, *args)
            check(rc == 2 and want in log, f"refused with exit 2 and '{want}' (P={np_}, got exit {rc})")
            if rc != 2 or want not in log:
                print(log)


def main():
    tmp = tempfile.mkdtemp(prefix="kfa_documents_")
    try:
        documents_end_to_end(tmp)
        refusals(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return apptest.finish()


if __name__ == "__main__":
    sys.exit(main())
