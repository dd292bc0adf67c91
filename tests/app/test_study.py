#!/usr/bin/env python3
"""perf/scaling_study.py on a tiny grid (issue 14): every CSV row comes from one run, so its tflops is the
attention FLOPs (4 * batch * heads * seq^2 * head_dim, halved when causal) over that row's own compute_s,
within 1%; min <= median <= max; rank counts are integers. With --doc-lognormal the rows give the documents
and count only each document's pairs (below the one-sequence count).

  test_study.py <scaling_study.py> <build dir> [mpiexec and its flags...]
"""
import csv
import os
import subprocess
import sys
import tempfile


def main():
    failed = study([])
    # A length mix: the rows count each document's pairs (Σ L² < N² with more than one document) and say the mix.
    failed |= study(["--doc-lognormal", "12,0.6,4,20,3"])
    return failed


def study(extra):
    script, build = sys.argv[1], sys.argv[2]
    mpiexec = sys.argv[3:]
    docs = bool(extra)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, script, "--build", build, "--out", out, "--ranks", "1,2", "--reps", "1",
               "--strong-seq", "64", "--per-rank", "32", "--lengths", "64", "--reference-max-n", "0",
               "--no-plots"] + extra
        if mpiexec:
            cmd += ["--mpiexec", mpiexec[0]] + (["--mpiexec-flags", " ".join(mpiexec[1:])] if mpiexec[1:] else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            print(r.stdout[-4000:], r.stderr[-4000:])
            print(f"FAIL: scaling_study.py exited {r.returncode}")
            return 1
        failures, checked = [], 0
        for name in ("strong.csv", "weak.csv", "causal.csv", "speed.csv"):
            path = os.path.join(out, name)
            if not os.path.exists(path):
                failures.append(f"{name} missing")
                continue
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            if not rows:
                failures.append(f"{name}: no rows")
            for i, row in enumerate(rows):
                n = int(row["seq"])
                flops = 4.0 * int(row["batch"]) * int(row["heads"]) * n * n * int(row["head_dim"])
                if row["causal"] in ("1", "True", "true"):
                    flops *= 0.5
                t, tf = float(row["compute_s"]), float(row["tflops"])
                want = flops / t * 1e-12
                if docs:
                    ndocs = int(row.get("documents") or 0)
                    if ndocs < 2 or not 0 < int(row.get("longest_document") or 0) < n:
                        failures.append(f"{name} row {i}: documents {row.get('documents')}, longest "
                                        f"{row.get('longest_document')} for a mix in {n} tokens")
                    elif not 0 < tf < 0.99 * want:
                        failures.append(f"{name} row {i}: tflops {tf} of a mix is not below the one-sequence "
                                        f"count's {want} (Σ L² < N²)")
                elif abs(tf - want) > 0.01 * want:
                    failures.append(f"{name} row {i}: tflops {tf} but FLOPs / compute_s = {want}")
                if not float(row["compute_s_min"]) <= t <= float(row["compute_s_max"]):
                    failures.append(f"{name} row {i}: compute_s {t} outside [min, max]")
                if "ranks" in row and row["ranks"] != str(int(float(row["ranks"]))):
                    failures.append(f"{name} row {i}: ranks {row['ranks']} is not an integer")
                checked += 1
        for f in failures:
            print("FAIL:", f)
        print(f"{' '.join(extra) or 'one sequence'}: {checked} rows checked, {len(failures)} failures")
        return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
