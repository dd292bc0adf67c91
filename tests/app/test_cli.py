#!/usr/bin/env python3
"""Command lines of the examples and benchmarks (issue 15, item 9): 0, negative and non-numeric values of
their numeric options, unknown options and missing values end with exit 2 and a message naming the
option and the value (no signal, no uncaught exception, no run); --help prints the program's help and
exits 0 without running; Kokkos' own --kokkos-* options still reach Kokkos.

  test_cli.py [--mpiexec MPIEXEC [flags...]] --binaries BINARY...

Each binary is recognised by its file name (kfa_example_forward, kfa_bench_sdpa, ...); the MPI programs
(kfa_example_ring, kfa_example_hdf5_roundtrip) run on 2 ranks through MPIEXEC when it is given.
"""
import os
import subprocess
import sys
import tempfile
import time

from apptest import kill_session, mpi_env

FAILURES = []


def parse_argv(argv):
    mpi, bins, where = [], [], None
    for a in argv:
        if a == "--mpiexec":
            where = mpi
        elif a == "--binaries":
            where = bins
        elif where is None:
            sys.exit(f"test_cli.py: unexpected argument {a!r}\n{__doc__}")
        else:
            where.append(a)
    return mpi, bins


MPI, BINARIES = parse_argv(sys.argv[1:])
MPI_PROGRAMS = {"kfa_example_ring", "kfa_example_hdf5_roundtrip", "kfa_example_hdf5_roundtrip_rank0", "kfa_bench_ring"}


def mem_available():
    """MemAvailable of /proc/meminfo in bytes (a huge number where it is unknown: nothing is then out of reach)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def check(cond, what, log=""):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)
        if log:
            print("     | " + log.strip().replace("\n", "\n     | ")[:3000], flush=True)


def run(binary, args, timeout=60, cwd=None):
    """(exit status, stdout, stderr, seconds); a signal is a negative status, a hang 124."""
    name = os.path.basename(binary)
    cmd = [binary] + [str(a) for a in args]
    if name in MPI_PROGRAMS and MPI:
        cmd = MPI[:1] + ["-n", "2"] + MPI[1:] + cmd
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         start_new_session=True, env=mpi_env())
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, time.time() - t0
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
        out, err = p.communicate()
        return 124, out or "", (err or "") + f"\n[killed after {timeout} s: hang]", time.time() - t0


def refused(binary, args, *words):
    """Exit 2, a message on stderr naming every one of `words`, nothing run (no result line on stdout)."""
    rc, out, err, _ = run(binary, args)
    name = os.path.basename(binary)
    what = f"{name} {' '.join(str(a) for a in args)}: exit 2"
    missing = [w for w in words if str(w) not in err]
    ok = rc == 2 and not missing and "PASS" not in out and "GFLOP" not in out and "Usage" not in out
    detail = f"exit {rc}" + (f", message lacks {missing}" if missing else "")
    check(ok, what + ("" if ok else f" ({detail})"), f"stdout: {out}\nstderr: {err}")
    if ok and "terminate called" in err:
        check(False, what + ": no uncaught exception", err)


def helps(binary, *options):
    rc, out, err, secs = run(binary, ["--help"])
    name = os.path.basename(binary)
    missing = [o for o in options if o not in out]
    ok = rc == 0 and "Usage" in out and not missing and "PASS" not in out + err and "GFLOP" not in out
    if name in MPI_PROGRAMS and MPI:
        ok = ok and out.count("Usage") == 1  # rank 0 alone prints it
    check(ok, f"{name} --help: exit 0 with the help, nothing run ({secs:.1f} s)" +
          ("" if ok else f" (exit {rc}, missing {missing})"), f"stdout: {out}\nstderr: {err}")


def numeric(binary, positive=(), nonnegative=(), extra=()):
    """0, negative and non-numeric values of positive options; negative and non-numeric of non-negative ones."""
    for opt in positive:
        for bad in ("0", "-5", "abc", "1.5", "99999999999999999999"):
            refused(binary, list(extra) + [opt, bad], opt, bad)
    for opt in nonnegative:
        for bad in ("-1", "abc", "2x"):
            refused(binary, list(extra) + [opt, bad], opt, bad)


def common(binary, extra=()):
    refused(binary, list(extra) + ["--bogus"], "--bogus")
    refused(binary, list(extra) + ["--no-such-option", "3"], "--no-such-option")


def example_forward(b):
    helps(b, "--seq", "--batch", "--heads", "--kv-heads", "--head-dim", "--causal", "--check", "--repeat")
    common(b)
    numeric(b, positive=("--seq", "--batch", "--heads", "--head-dim", "--repeat"),
            nonnegative=("--kv-heads", "--check"))
    refused(b, ["--seq"], "--seq")  # a value missing
    refused(b, ["--heads", "4", "--kv-heads", "3"], "--heads 4", "--kv-heads 3")
    refused(b, ["--heads", "2", "--kv-heads", "4"], "--heads 2", "--kv-heads 4")
    # Sizes it cannot fill (issue 34): a View of 2^31 elements or more, more memory than there is.
    refused(b, ["--seq", "1073741824"], "--seq 1073741824", "q [1, 1073741824, 8, 128]", "2^31")
    refused(b, ["--seq", "1073741824", "--batch", "1073741824"], "--batch 1073741824", "more than 2^64")
    need = 4 * 4 * (4194303 * 4 * 128)  # q, k, v, o in float, each just below 2^31 elements
    if mem_available() < need:
        refused(b, ["--seq", "4194303", "--heads", "4", "--head-dim", "128"], "--seq 4194303", "MemAvailable")
    rc, out, err, _ = run(b, ["--seq", 64, "--heads", 2, "--head-dim", 16, "--check", 2, "--repeat", 1,
                              "--kokkos-threads=1"])
    check(rc == 0 and "PASS" in out, "kfa_example_forward: a small run with --kokkos-threads=1 passes", out + err)


def example_backward(b):
    helps(b)
    common(b)
    refused(b, ["extra"], "extra")


def example_ring(b):
    helps(b, "--seq", "--heads", "--head-dim")
    common(b)
    numeric(b, positive=("--seq", "--heads", "--head-dim"))
    refused(b, ["--seq", "3"], "--seq 3")  # shorter than 2 x 2 ranks
    refused(b, ["--seq", "1073741824"], "--seq 1073741824", "q [1, 1073741824, 4, 64]", "2^31")
    rc, out, err, _ = run(b, ["--seq", 64, "--heads", 1, "--head-dim", 16, "--kokkos-threads=1"])
    check(rc == 0 and "PASS" in out, "kfa_example_ring: a small run with --kokkos-threads=1 passes", out + err)


def example_hdf5(b):
    helps(b)
    common(b)
    with tempfile.TemporaryDirectory() as d:
        refused(b, [os.path.join(d, "a.h5"), os.path.join(d, "b.h5")], "b.h5")
        refused(b, [""], "file")


def bench_forward(b):
    helps(b, "--n", "--d", "--heads", "--reps", "--gemm-n", "--reference-max-n", "--no-reference", "--markdown",
          "--guard", "--guard-ratio")
    common(b)
    numeric(b, positive=("--n", "--d", "--heads", "--reps", "--gemm-n"), nonnegative=("--reference-max-n",))
    refused(b, ["--n", "512,0"], "--n", "0")
    refused(b, ["--d", "64,abc"], "--d", "abc")
    for bad in ("0", "-1", "abc", "nan", "inf"):
        refused(b, ["--guard", "--guard-ratio", bad], "--guard-ratio", bad)


def bench_backward(b):
    helps(b, "--n", "--d", "--heads", "--reps", "--gemm-n", "--reference-max-n", "--markdown")
    common(b)
    numeric(b, positive=("--n", "--d", "--heads", "--reps", "--gemm-n"), nonnegative=("--reference-max-n",))
    refused(b, ["--n", "1024,-3"], "--n", "-3")


def bench_sdpa(b):
    helps(b, "--out", "--dtypes", "--d", "--n", "--causal", "--tokens", "--hidden", "--reps", "--path", "--seed",
          "--no-backward")
    with tempfile.TemporaryDirectory() as d:
        out = ["--out", d]
        common(b, out)
        numeric(b, positive=("--d", "--n", "--tokens", "--hidden", "--reps"), nonnegative=("--seed",), extra=out)
        refused(b, out + ["--causal", "2"], "--causal", "2")
        refused(b, out + ["--causal", "0,abc"], "--causal", "abc")
        refused(b, out + ["--dtypes", "fp32,int8"], "--dtypes", "int8")
        refused(b, out + ["--path", "fastest"], "--path", "fastest")
        refused(b, ["--n", "512"], "--out")  # required


def bench_ring(b):
    helps(b, "--tokens-per-rank", "--seq", "--heads", "--kv-heads", "--head-dim", "--reps", "--layout", "--dtype",
          "--max-message-bytes", "--causal", "--backward", "--steps")
    common(b)
    numeric(b, positive=("--tokens-per-rank", "--seq", "--heads", "--kv-heads", "--head-dim", "--reps",
                         "--max-message-bytes"))
    refused(b, ["--layout", "spiral"], "--layout", "spiral")
    refused(b, ["--dtype", "int8"], "--dtype", "int8")
    refused(b, ["--heads", "4", "--kv-heads", "3"], "--kv-heads 3", "--heads 4")
    rc, out, err, _ = run(b, ["--tokens-per-rank", 64, "--heads", 2, "--head-dim", 16, "--reps", 1,
                              "--max-message-bytes", 1000, "--kokkos-threads=1"])
    check(rc == 0 and "kfa_bench_ring P=" in out, "kfa_bench_ring: a small run with chunked messages", out + err)


def example_varlen(b):
    helps(b, "--lengths", "--heads", "--kv-heads", "--head-dim", "--causal")
    common(b)
    numeric(b, positive=("--heads", "--kv-heads", "--head-dim"))
    refused(b, ["--lengths", "10,-1"], "--lengths", "-1")
    refused(b, ["--heads", "4", "--kv-heads", "3"], "--heads 4", "--kv-heads 3")
    refused(b, ["--head-dim", "12"], "head_dim", "12")
    rc, out, err, _ = run(b, ["--lengths", "5,0,40", "--heads", 2, "--kv-heads", 1, "--head-dim", 16, "--causal"])
    check(rc == 0 and "ok: every sequence equals its own call" in out, "kfa_example_varlen: a small run passes",
          out + err)


def bench_varlen(b):
    helps(b, "--dtype", "--d", "--hidden", "--causal", "--reps", "--lengths", "--tokens", "--min", "--max", "--median",
          "--sigma", "--seed", "--path", "--no-backward")
    common(b)
    numeric(b, positive=("--d", "--hidden", "--reps", "--tokens", "--min", "--max", "--median"))
    refused(b, ["--lengths", "10,0"], "--lengths")
    refused(b, ["--dtype", "int8", "--lengths", "16"], "--dtype int8")
    rc, out, err, _ = run(b, ["--dtype", "fp32", "--d", 16, "--hidden", 32, "--lengths", "40,7,90", "--reps", 1,
                              "--causal", "1"])
    check(rc == 0 and "varlen fp32 16 1 3 137 2" in out and "fixed_equal_flops" in out,
          "kfa_bench_varlen: a small run prints the packed and the fixed-length case", out + err)


TABLE = {
    "kfa_example_varlen": example_varlen,
    "kfa_bench_varlen": bench_varlen,
    "kfa_bench_ring": bench_ring,
    "kfa_example_forward": example_forward,
    "kfa_example_backward": example_backward,
    "kfa_example_ring": example_ring,
    "kfa_example_hdf5_roundtrip": example_hdf5,
    "kfa_example_hdf5_roundtrip_rank0": example_hdf5,
    "kfa_bench_forward": bench_forward,
    "kfa_bench_backward": bench_backward,
    "kfa_bench_sdpa": bench_sdpa,
}


def main():
    if not BINARIES:
        sys.exit(f"test_cli.py: no binaries given\n{__doc__}")
    for b in BINARIES:
        name = os.path.basename(b)
        if name not in TABLE:
            check(False, f"{name}: no command-line cases known for this program")
            continue
        if not os.access(b, os.X_OK):
            check(False, f"{b}: not an executable")
            continue
        if name in MPI_PROGRAMS and not MPI:
            print(f"note {name}: no --mpiexec given, run as a singleton", flush=True)
        TABLE[name](b)
    print(f"\n{len(FAILURES)} failure(s)" + "".join(f"\n  {f}" for f in FAILURES), flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
