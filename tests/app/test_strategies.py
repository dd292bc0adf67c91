#!/usr/bin/env python3
"""kfa-longseq's sequence-parallel strategies: --sp ring | ulysses | hybrid | auto and --ulysses-degree. Each result
equals float64 numpy (and the ring's result) at 1 to 4 ranks, both layouts, GQA; the report and the JSON say which
strategy ran, why, and what the all-to-all sent; --sp auto's predictions equal perf/ring_model.py --strategies
fed with the run's own calibration; bad combinations are refused with a message naming the options and exit 2.

  test_strategies.py APP RING_MODEL MPIEXEC [MPIEXEC flags...]
"""
import json
import os
import subprocess
import sys
import tempfile

import h5py
import numpy as np

import apptest

APP = sys.argv[1]
MODEL = sys.argv[2]
MPI = sys.argv[3:]
check = apptest.check


def run(np_, *args, **kw):
    """Runs the app on np_ ranks (apptest.run_app: a hang is killed and returns 124)."""
    return apptest.run_app(MPI, APP, np_, *args, **kw)


def end_to_end(tmp):
    s, h, hkv, d, seed = 61, 12, 4, 16, 3
    x = {n: apptest.generated(seed, i, (1, s, hh, d)).astype("float64")
         for n, i, hh in (("q", 0, h), ("k", 1, hkv), ("v", 2, hkv), ("do", 3, h))}
    ref = dict(zip(("o", "lse", "dq", "dk", "dv"), apptest.reference(x["q"], x["k"], x["v"], x["do"], True)))
    cases = [(1, "ulysses", None, "zigzag"), (2, "ulysses", None, "zigzag"), (2, "ring", None, "contiguous"),
             (3, "ulysses", None, "contiguous"), (4, "hybrid", 2, "zigzag"), (4, "ulysses", None, "contiguous"),
             (4, "hybrid", 2, "contiguous"), (2, "auto", None, "zigzag")]
    for np_, sp, deg, layout in cases:
        out, js = os.path.join(tmp, f"{sp}_{np_}_{layout}.h5"), os.path.join(tmp, f"{sp}_{np_}_{layout}.json")
        extra = ["--ulysses-degree", deg] if deg else []
        rc, log = run(np_, "--generate", "--seqlen", s, "--heads", h, "--kv-heads", hkv, "--head-dim", d, "--seed",
                      seed, "--dtype", "float64", "--causal", "--layout", layout, "--backward", "--check", 4, "--sp",
                      sp, *extra, "--output", out, "--json", js)
        tag = f"--sp {sp}{' --ulysses-degree ' + str(deg) if deg else ''}, P={np_} {layout}"
        if rc != 0:
            check(False, f"{tag}: exit {rc}")
            print(log)
            continue
        with h5py.File(out, "r") as f:
            got = {n: f[n][...] for n in ("o", "lse", "dq", "dk", "dv")}
        for n in got:
            err = np.max(np.abs(got[n] - ref[n])) / max(1e-30, np.max(np.abs(ref[n])))
            check(err < 1e-10, f"{tag}: {n} vs float64 numpy (max rel {err:.2e})")
        j = json.load(open(js))
        u = {"ring": 1, "ulysses": np_, "hybrid": deg}.get(sp, j["ulysses_degree"])
        kind = "ring" if u == 1 else "ulysses" if u == np_ else "hybrid"
        check(j["sp"] == kind and j["ulysses_degree"] == u and j["ring_degree"] == np_ // u,
              f"{tag}: JSON sp {j['sp']}, U {j['ulysses_degree']}, R {j['ring_degree']}")
        check((j["a2a_bytes"] > 0) == (u > 1), f"{tag}: all-to-all bytes {j['a2a_bytes']} (U = {u})")
        check(f"sequence parallelism: {kind} (Ulysses degree {u}" in log, f"{tag}: the report names the strategy")
        if u > 1:
            check("all-to-all: to heads" in log and "heads: 12 query heads, 4 key/value heads" in log,
                  f"{tag}: the report splits the all-to-all and says how the heads went")
        if sp == "auto":
            check(j["sp_reason"].startswith("auto: predicted ring "), f"{tag}: why: {j['sp_reason']}")
            pred = j["sp_predicted_s"]
            check(j["sp"] == ("ring" if pred["ring"] <= pred["ulysses"] else "ulysses"),
                  f"{tag}: the smallest prediction ran ({pred})")
            # perf/ring_model.py --strategies with this run's calibration predicts the same times
            csv_path = os.path.join(tmp, "model.csv")
            p = subprocess.run([sys.executable, MODEL, "--strategies", "--from-json", js, "--csv", csv_path],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            check(p.returncode == 0, f"{tag}: ring_model.py --strategies --from-json (exit {p.returncode})")
            if p.returncode == 0:
                import csv
                rows = {r["strategy"]: float(r["total_s"]) for r in csv.DictReader(open(csv_path))}
                same = rows.keys() == pred.keys() and all(abs(rows[k] - pred[k]) <= 1e-9 + 1e-6 * pred[k]
                                                          for k in pred)
                check(same, f"{tag}: ring_model.py predicts what the app did ({rows} vs {pred})")


def refusals():
    base = ["--generate", "--seqlen", 64, "--heads", 6, "--head-dim", 16, "--dtype", "float64"]
    for np_, extra, want in (
            (4, ["--sp", "ulysses"], "the 6 query heads (--heads) are not divisible by the Ulysses degree 4"),
            (2, ["--sp", "hybrid"], "--sp hybrid needs --ulysses-degree U"),
            (4, ["--sp", "hybrid", "--ulysses-degree", 3], "--ulysses-degree 3 does not divide the 4 ranks"),
            (2, ["--sp", "ring", "--ulysses-degree", 2], "--ulysses-degree 2 with --sp ring"),
            (2, ["--sp", "ulysses", "--ulysses-degree", 1], "--sp ulysses spreads the heads over all 2 ranks"),
            (1, ["--sp", "bogus"], "--sp: bogus not in {ring,ulysses,hybrid,auto}")):
        rc, log = run(np_, *base, *extra, timeout=60)
        check(rc == 2 and want in log, f"P={np_} {' '.join(map(str, extra))}: exit {rc} naming it")
        if not (rc == 2 and want in log):
            print(log)
    # auto with documents: the largest Ulysses degree within a node, and why
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "docs.json")
        rc, log = run(2, *base, "--doc-lengths", "30,34", "--sp", "auto", "--json", js, timeout=60)
        j = json.load(open(js)) if rc == 0 else {}
        ok = j.get("sp") == "ulysses" and j.get("sp_reason") == "auto: packed documents: Ulysses degree 2, the " \
            "largest the heads allow within a node (every document whole on each rank)"
        check(ok, "--sp auto with documents runs Ulysses and says why")
        if not ok:
            print(log)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        end_to_end(tmp)
    refusals()
    return apptest.finish()


if __name__ == "__main__":
    sys.exit(main())
