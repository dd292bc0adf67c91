#!/usr/bin/env python3
"""End-to-end tests of kfa-longseq: HDF5 files written by h5py (float16/32/64), results against a numpy
float64 reference, rank-count independence of --generate, bad inputs, and never a partial output file; long
names, --help, progress, the report's time split, --check of the gradients, the JSON and typed attributes.

  test_longseq.py APP MPIEXEC [MPIEXEC flags...]
"""
import hashlib
import json
import os
import pty
import select
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

import apptest
from apptest import kill_session, mpi_env, reference

APP = sys.argv[1]
MPI = sys.argv[2:]
check = apptest.check


def run(np_, *args, **kw):
    """Runs the app on np_ ranks (apptest.run_app: a hang is killed and returns 124)."""
    return apptest.run_app(MPI, APP, np_, *args, **kw)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def temporaries(directory):
    return [x for x in os.listdir(directory) if ".tmp-" in x]


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return np.inf
    return np.linalg.norm(a - b) / np.linalg.norm(b)


GEN = ("--generate", "--seqlen", 128, "--heads", 2, "--head-dim", 16)


def output_safety(tmp):
    """Issue 15, items 1, 2, 3 and 7: outputs never destroy the input or each other, are checked before the
    run, are committed only when everything succeeded, and a full disk changes nothing (no hang, no crash)."""
    d = os.path.join(tmp, "safety")
    os.makedirs(d)
    inp = os.path.join(d, "in.h5")
    rng = np.random.default_rng(5)
    with h5py.File(inp, "w") as f:
        for name, hh in (("q", 2), ("k", 2), ("v", 2)):
            f[name] = rng.standard_normal((1, 64, hh, 16)).astype(np.float32)
    in_hash = sha256(inp)
    os.symlink("in.h5", os.path.join(d, "link.h5"))
    out = os.path.join(d, "out.h5")
    js = os.path.join(d, "summary.json")
    rc, log = run(2, "--input", inp, "--output", out, "--json", js, "--check", 2)
    check(rc == 0 and os.path.exists(out) and os.path.exists(js),
          f"safety: a good run writes out.h5 and the JSON (exit {rc})")
    if rc != 0:
        print(log)
        return
    out_hash, js_hash = sha256(out), sha256(js)

    # Outputs that are the input, or each other: refused before any work, exit 2, nothing changed.
    aliases = [
        ("--output same path as --input", ("--input", inp, "--output", inp), ("--output", "--input")),
        ("--output ./in.h5 (relative)", ("--input", "in.h5", "--output", "./in.h5"), ("--output", "--input")),
        ("--output a symlink to --input", ("--input", inp, "--output", os.path.join(d, "link.h5")),
         ("--output", "--input")),
        ("--output a/../ path to --input", ("--input", inp, "--output", os.path.join(d, "..", "safety", "in.h5")),
         ("--output", "--input")),
        ("--json same path as --input", ("--input", inp, "--json", inp), ("--json", "--input")),
        ("--json a symlink to --input", ("--input", "in.h5", "--json", "link.h5"), ("--json", "--input")),
        ("--json same path as --output", ("--input", inp, "--output", out, "--json", out), ("--json", "--output")),
        ("--json ./out.h5 = --output out.h5", ("--input", inp, "--output", "out.h5", "--json", "./out.h5"),
         ("--json", "--output")),
        ("--json = --output, neither existing yet", ("--input", inp, "--output", "new.h5", "--json", "./new.h5"),
         ("--json", "--output")),
    ]
    saved = {p: open(p, "rb").read() for p in (inp, out, js)}
    for what, args, names in aliases:
        for p, data in saved.items():  # each case on intact files (a failing build destroys them)
            with open(p, "wb") as f:
                f.write(data)
        if not os.path.islink(os.path.join(d, "link.h5")):
            os.remove(os.path.join(d, "link.h5"))
            os.symlink("in.h5", os.path.join(d, "link.h5"))
        rc, log = run(2, *args, cwd=d)
        named = all(n in log for n in names) and "same file" in log
        kept = sha256(inp) == in_hash and sha256(out) == out_hash and sha256(js) == js_hash
        check(rc == 2 and named and kept and not os.path.exists(os.path.join(d, "new.h5")) and "TFLOP/s" not in log,
              f"safety: {what}: exit {rc} (want 2), names both options: {named}, "
              f"input and outputs byte-identical: {kept}")
        if rc != 2 or not named:
            print(log)

    for p, data in saved.items():
        with open(p, "wb") as f:
            f.write(data)

    # Outputs that cannot be written are found before the run, not after it.
    for what, args, frag in [
        ("--json into a missing directory", ("--json", os.path.join(d, "missing", "s.json")), "does not exist"),
        ("--output into a missing directory", ("--output", os.path.join(d, "missing", "o.h5")), "does not exist"),
        ('--output ""', ("--output", ""), "--output needs a file name"),
        ('--json ""', ("--json", ""), "--json needs a file name"),
        ("--output a directory", ("--output", d), "directory"),
        ("--check-tol without --check", ("--check-tol", "0"), "--check-tol needs --check"),
    ]:
        rc, log = run(2, *GEN, *args)
        check(rc == 2 and frag in log and "TFLOP/s" not in log,
              f"safety: {what}: exit {rc} (want 2) before the run, says '{frag}'")
    ro = os.path.join(d, "ro")
    os.makedirs(ro)
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", ro],
                                 capture_output=True).returncode == 0
    else:
        os.chmod(ro, 0o555)
        mounted = True
    if mounted:
        rc, log = run(2, *GEN, "--json", os.path.join(ro, "s.json"))
        check(rc == 2 and "not writable" in log and "TFLOP/s" not in log,
              f"safety: --json into a read-only directory: exit {rc} before the run")
        if os.geteuid() == 0:
            subprocess.run(["umount", ro])
    else:
        print("skip read-only directory case: cannot mount a read-only tmpfs")

    # A failed --check (exit 3) writes nothing: the previous output and JSON stay byte-identical.
    for nranks in (1, 2):
        rc, log = run(nranks, "--input", inp, "--output", out, "--json", js, "--check", 2, "--check-tol", 0)
        kept = sha256(out) == out_hash and sha256(js) == js_hash
        check(rc == 3 and "FAIL" in log and kept and not temporaries(d),
              f"safety: failed --check on {nranks} rank(s): exit {rc} (want 3), "
              f"old output and JSON byte-identical: {kept}, no temporary left: {not temporaries(d)}")

    # Temporaries of an earlier killed run are named (not silently left, not removed behind the user's back).
    stale = out + ".tmp-1234"
    with open(stale, "wb") as f:
        f.write(b"x" * 100)
    rc, log = run(2, "--input", inp, "--output", out, "--check", 1)
    check(rc == 0 and stale in log and "warning" in log and os.path.exists(stale),
          "safety: a stale temporary is named in a warning")
    os.remove(stale)
    out_hash = sha256(out)

    full_filesystem(d)


def open_mpi_4():
    """True when the MPI launcher is Open MPI 4.x (whose MPI-IO aborts on paths longer than ~244 characters)."""
    try:
        v = subprocess.run([MPI[0], "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return ("Open MPI" in v or "OpenRTE" in v) and " 4." in v


def long_names_and_debris(tmp):
    """Issue 15, items 10 and 11. A legal 250-character output name (and JSON name) works and the result has
    exactly the user's name (c8edcdf: SIGABRT in Open MPI 4.1's shared file-pointer component; later "File
    name too long" for the temporary); an input whose absolute path has over 250 characters is read; a name over
    NAME_MAX is refused before the run; with Open MPI's lockedfile component selected on purpose, a path it
    cannot take is refused with the limit, not a SIGABRT. A run killed while writing leaves its temporary,
    and the next run writing the same output names it."""
    d = os.path.join(tmp, "names")
    os.makedirs(d)
    name = "n" * 246 + ".h5"
    jname = "j" * 245 + ".json"
    for np_ in (1, 2):
        rc, log = run(np_, *GEN, "--output", name, "--json", jname, "--check", 2, cwd=d, timeout=120)
        ok = rc == 0 and os.path.exists(os.path.join(d, name)) and os.path.exists(os.path.join(d, jname))
        if ok:
            with h5py.File(os.path.join(d, name), "r") as f:
                ok = f["o"].shape == (1, 128, 2, 16) and bool(np.isfinite(f["o"][...]).all())
            ok = ok and json.load(open(os.path.join(d, jname)))["ranks"] == np_
        check(ok and not temporaries(d) and "Aborted" not in log,
              f"names: --output of 250 characters, --json of 250, P={np_}: exit {rc} (want 0), both written under the "
              f"user's names, no temporary left: {not temporaries(d)}")
        if not ok:
            print(log[-3000:])
    # An input deep in a directory tree: its absolute path is longer than Open MPI 4's 244.
    deep = os.path.join(d, "x" * 120, "y" * 120)
    os.makedirs(deep)
    inp = os.path.join(deep, "in.h5")
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 64, 2, 16)).astype(np.float32) for _ in range(3))
    with h5py.File(inp, "w") as f:
        f["q"], f["k"], f["v"] = q, k, v
    out = os.path.join(deep, "out.h5")
    rc, log = run(2, "--input", inp, "--output", out, timeout=120)
    ok = rc == 0 and os.path.exists(out)
    if ok:
        with h5py.File(out, "r") as f:
            ok = rel(f["o"][...], reference(q, k, v, q, causal=False)[0]) <= 1e-5
    check(ok and len(inp) > 250, f"names: --input and --output with absolute paths of {len(inp)} characters, P=2: "
                                 f"exit {rc} (want 0), o correct: {ok}")
    if not ok:
        print(log[-3000:])
    rc, log = run(2, *GEN, "--output", "o" * 253 + ".h5", cwd=d, timeout=60)
    check(rc == 2 and "NAME_MAX" in log and "256 characters" in log and "TFLOP/s" not in log,
          f"names: --output of 256 characters refused before the run: exit {rc} (want 2), names NAME_MAX")
    if open_mpi_4():
        for what, args in (("--input", ("--input", inp)), ("--output", (*GEN, "--output", out))):
            rc, log = run(2, *args, timeout=60, env={"OMPI_MCA_sharedfp": "lockedfile"})
            said = "aborts MPI_File_open on paths longer than 244" in log and what in log
            check(rc == 2 and said and "Aborted" not in log and "TFLOP/s" not in log,
                  f"names: OMPI_MCA_sharedfp=lockedfile, {what} path of {len(out)}+ characters: exit {rc} (want 2, "
                  f"not SIGABRT), names the limit: {said}")
            if rc != 2 or not said:
                print(log[-3000:])
    else:
        print("skip the Open MPI 4 lockedfile path-limit cases: the launcher is not Open MPI 4")

    # Item 10: SIGKILL while the output is being written leaves <output>.tmp-*; the next run names it.
    kd = os.path.join(d, "killed")
    os.makedirs(kd)
    killed = os.path.join(kd, "out.h5")
    cmd = MPI[:1] + ["-n", "1"] + MPI[1:] + [APP, "--generate", "--batch", "16", "--seqlen", "1024", "--heads", "8",
                                             "--head-dim", "64", "--output", killed]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    while not temporaries(kd) and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.001)
    kill_session(p.pid)  # the rank itself, as a node failure or the OOM killer would
    p.wait()
    time.sleep(1)  # an orphaned rank would have finished and renamed its temporary by now
    debris = sorted(temporaries(kd))
    check(debris and not os.path.exists(killed),
          f"names: SIGKILL while writing: no output, the temporary left behind ({debris}; want at least one)")
    if debris:
        rc, log = run(1, *GEN, "--output", killed, timeout=60)
        named = all(os.path.join(kd, x) in log for x in debris)
        check(rc == 0 and named and "did not finish" in log
              and all(os.path.exists(os.path.join(kd, x)) for x in debris),
              f"names: the next run names the killed run's temporaries in a warning (exit {rc}, named: {named})")
        if not named:
            print(log[-3000:])


def run_split(np_, *args, timeout=300, env=None):
    """Like run(), with stdout and stderr apart and carriage returns kept (no universal newlines):
    (exit status, stdout, stderr)."""
    cmd = MPI[:1] + ["-n", str(np_)] + MPI[1:] + [APP] + [str(a) for a in args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         env=mpi_env(env))
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
        out, err = p.communicate()
        return 124, (out or b"").decode(errors="replace"), (err or b"").decode(errors="replace") + \
            f"\n[killed after {timeout} s: hang]"


def help_and_progress(tmp):
    """Issue 14: --help shows defaults and units; progress reaches a person whose stderr is not a terminal
    (one line per ring step with elapsed time and ETA, at most one per --progress-interval s), --quiet
    silences it (c8edcdf: a bar only on a terminal or with --progress, \r-joined lines in a file)."""
    rc, out, err = run_split(1, "--help", timeout=60)
    text = out + err
    want = ["--seqlen INT:POSITIVE=65536", "tokens", "--heads INT:POSITIVE=4", "--head-dim INT:POSITIVE=64",
            "--dtype TEXT:{float64,float32,float16,bfloat16}=float32", "=1/sqrt(head_dim)", "=contiguous",
            "=1073741824 (1 GiB)", "bytes", "seconds", "--quiet", "--progress-interval", "seq >= 2 x ranks"]
    missing = [w for w in want if w not in text]
    check(rc == 0 and not missing and "TFLOP/s" not in text, f"--help: exit {rc} (want 0), defaults and units shown "
                                                              f"(missing: {missing})")
    base = ("--generate", "--seqlen", 256, "--heads", 2, "--head-dim", 16, "--causal", "--layout", "zigzag")
    rc, out, err = run_split(2, *base, "--backward", "--progress-interval", 0, timeout=120)
    steps = [x for x in err.splitlines() if " ring step " in x]
    want = [f"{w} ring step {i}/2 done" for w in ("forward", "backward") for i in (1, 2)]
    ok = rc == 0 and all(any(w in x for x in steps) for w in want) and all("elapsed" in x and "ETA" in x for x in steps)
    check(ok and "\r" not in err and "TFLOP/s" in out,
          f"progress on a pipe, 2 ranks, --progress-interval 0: a line per ring step of each pass with elapsed and "
          f"ETA, no \\r (exit {rc}, {len(steps)} lines)")
    if not ok:
        print(err[-2000:])
    rc, out, err = run_split(2, *base, "--backward", timeout=120)
    check(rc == 0 and not [x for x in err.splitlines() if " ring step " in x] and "computing forward+backward" in err,
          f"progress on a pipe, default interval 10 s, a run shorter than that: the start line, no step lines "
          f"(exit {rc})")
    rc, out, err = run_split(2, *base, "--quiet", "--progress-interval", 0, timeout=120)
    check(rc == 0 and "ring step" not in err and "computing" not in err and "TFLOP/s" in out,
          f"--quiet: no progress on stderr, the report on stdout (exit {rc})")
    # On a terminal a bar. Open MPI's mpirun gives every rank a pipe for stderr even on a terminal, so the
    # terminal case runs as a singleton (no mpirun) with stderr on a pseudo-terminal; --progress asks for the
    # bar under mpirun.
    m, sl = pty.openpty()
    p = subprocess.Popen([APP, *map(str, base[:7]), "--backward"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=sl, start_new_session=True)
    os.close(sl)
    tty = b""
    t0 = time.time()
    while time.time() - t0 < 60:
        try:
            chunk = os.read(m, 4096)
        except OSError:
            break
        if not chunk:
            break
        tty += chunk
    os.close(m)
    try:
        p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
    tty = tty.decode(errors="replace")
    check(p.returncode == 0 and "\r" in tty and "[##" in tty and "ring step 1/1" in tty and "ETA" in tty
          and "computing" not in tty, f"progress on a terminal (singleton, stderr a pty): a bar (exit {p.returncode})")
    if "\r" not in tty:
        print(repr(tty[-500:]))
    rc, out, err = run_split(2, *base, "--progress", timeout=120)
    check(rc == 0 and "\r" in err and "[##" in err and "ring step 2/2" in err,
          f"--progress under mpirun: the bar (exit {rc})")
    rc, out, err = run_split(1, *base, "--quiet", "--progress", timeout=60)
    check(rc == 2 and "--quiet" in err and "--progress" in err, f"--quiet with --progress refused: exit {rc} (want 2)")


def documented_attributes():
    """{name: type} from the table in apps/README.md's 'output attributes' section."""
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "apps", "README.md")
    table, on = {}, False
    for line in open(readme):
        if line.startswith("## "):
            on = "output attributes" in line
        elif on and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            table[cells[0].strip("`")] = cells[1]
    return table, open(readme).read()


def reports_and_attributes(tmp):
    """Issue 14: where dO came from is said (report, JSON, attribute); --check verifies dq/dk/dv with --backward
    and fails on a corrupted gradient (the KFA_LONGSEQ_CORRUPT test hook); JSON 'check' is null without a
    check; the report's time split (compute, load imbalance, communication not hidden) and 'hidden' from a
    measured transfer time (n/a at P = 1); output attributes typed as apps/README.md documents them, with the
    scale applied."""
    d = os.path.join(tmp, "report")
    os.makedirs(d)
    rng = np.random.default_rng()
    b, s, h, hkv, dd = 2, 97, 4, 2, 16  # batch 2 and shards of unequal length (33, 32, 32 at P = 3)
    q, k, v, do = (rng.standard_normal((b, s, hh, dd)).astype(np.float32) for hh in (h, hkv, hkv, h))
    with_do, without_do = os.path.join(d, "with_do.h5"), os.path.join(d, "without_do.h5")
    for path, extra in ((with_do, {"do": do}), (without_do, {})):
        with h5py.File(path, "w") as f:
            f["q"], f["k"], f["v"] = q, k, v
            for n, x in extra.items():
                f[n] = x

    # dO generated or read: said in the report, the JSON and the attributes.
    for path, source in ((without_do, "generated"), (with_do, "file")):
        out, js = os.path.join(d, f"do_{source}.h5"), os.path.join(d, f"do_{source}.json")
        rc, log = run(2, "--input", path, "--backward", "--output", out, "--json", js, timeout=120)
        rep = json.load(open(js)) if rc == 0 else {}
        attr = None
        if rc == 0:
            with h5py.File(out, "r") as f:
                attr = f.attrs.get("do_source")
        said = ("dO: generated (seed 1): " + path + " has no dataset 'do'") in log if source == "generated" else \
            ("dO: dataset 'do' of " + path) in log
        check(rc == 0 and said and rep.get("do_source") == source and attr == source,
              f"dO {source}: report line {said}, JSON do_source {rep.get('do_source')!r}, attribute {attr!r} "
              f"(exit {rc})")
        if not said:
            print(log)
    rc, log = run(1, "--input", with_do, "--json", os.path.join(d, "fwd.json"), timeout=60)
    rep = json.load(open(os.path.join(d, "fwd.json"))) if rc == 0 else {}
    check(rc == 0 and "do_source" in rep and rep["do_source"] is None and "dO:" not in log,
          f"no --backward: do_source null, no dO line (exit {rc})")

    # --check: JSON null without it; gradients checked with --backward, and a corrupted gradient fails it.
    check(rc == 0 and "check" in rep and rep["check"] is None and "check_pass" not in rep,
          f"no --check: JSON check is null and no check_pass (got {rep.get('check', 'missing')!r})")
    js = os.path.join(d, "chk.json")
    rc, log = run(2, "--input", with_do, "--check", 3, "--json", js, timeout=120)
    rep = json.load(open(js)) if rc == 0 else {}
    check(rc == 0 and rep.get("check", {}).get("pass") is True and rep["check"]["gradients"] is None
          and rep["check"]["rows"] == 6, f"--check without --backward: check.pass true, gradients null (exit {rc})")
    for np_, layout, extra in ((2, "zigzag", ("--causal",)), (3, "contiguous", ("--softcap", 3, "--window", 20, 5))):
        js = os.path.join(d, f"grad_{np_}.json")
        out = os.path.join(d, f"grad_{np_}.h5")
        rc, log = run(np_, "--input", with_do, "--backward", "--check", 3, "--layout", layout, *extra, "--json", js,
                      "--output", out, timeout=120)
        g = (json.load(open(js)).get("check") or {}).get("gradients") if rc == 0 else None
        ok = bool(g) and g["query_rows"] == 3 * np_ and g["key_rows"] == 3 * np_ and \
            all(0 <= g[x] <= 1e-4 for x in ("dq_rel_error", "dk_rel_error", "dv_rel_error"))
        check(ok and "check gradients: dq" in log, f"--check --backward, P={np_} {layout} {' '.join(map(str, extra))}: "
                                                   f"dq/dk/dv checked and pass (exit {rc}, {g})")
        if not ok:
            print(log)
        if rc == 0:  # the check's float64 gradients agree with numpy's: the written ones are within 1e-5 of both
            ref = reference(q, k, v, do, causal="--causal" in extra,
                            window=(20, 5) if "--window" in extra else (-1, -1),
                            softcap=3.0 if "--softcap" in extra else 0.0)
            with h5py.File(out, "r") as f:
                errs = [rel(f[n][...], r) for n, r in zip(("dq", "dk", "dv"), ref[2:])]
            check(max(errs) <= 1e-5, f"  and the written gradients match numpy (errors {errs})")
    keep = os.path.join(d, "keep.h5")
    with open(keep, "wb") as f:
        f.write(b"previous")
    for what in ("dq", "dk", "dv", "o"):
        js = os.path.join(d, f"corrupt_{what}.json")
        rc, log = run(2, "--input", with_do, "--backward", "--check", 3, "--output", keep, "--json", js, timeout=120,
                      env={"KFA_LONGSEQ_CORRUPT": what})
        check(rc == 3 and "FAIL" in log and open(keep, "rb").read() == b"previous" and not os.path.exists(js),
              f"--check --backward with {what} corrupted by 1e-3 (test hook): exit {rc} (want 3), FAIL, "
              "nothing written")
    # --nondeterministic: said in the report, JSON and attributes; on the CPU no family has atomics, so the
    # gradients are bitwise those of the default run above (do_file.h5).
    out, js = os.path.join(d, "nondet.h5"), os.path.join(d, "nondet.json")
    rc, log = run(2, "--input", with_do, "--backward", "--nondeterministic", "--output", out, "--json", js, timeout=120)
    same, attr, rep = False, None, {}
    if rc == 0:
        rep = json.load(open(js))
        with h5py.File(out, "r") as f, h5py.File(os.path.join(d, "do_file.h5"), "r") as g:
            attr = f.attrs.get("deterministic")
            same = all(np.array_equal(f[n][...], g[n][...]) for n in ("o", "lse", "dq", "dk", "dv"))
            same = same and g.attrs.get("deterministic") == True  # noqa: E712 (numpy bool)
    check(rc == 0 and "forward+backward (nondeterministic dq)" in log and rep.get("deterministic") is False
          and attr == False and same,  # noqa: E712
          f"--nondeterministic: report, JSON deterministic={rep.get('deterministic')!r}, attribute {attr!r}, "
          f"outputs bitwise equal to the default run on the CPU: {same} (exit {rc})")
    rc, log = run(2, "--input", with_do, "--backward", "--output", os.path.join(d, "unchecked.h5"), timeout=120,
                  env={"KFA_LONGSEQ_CORRUPT": "dk"})
    check(rc == 0, f"the same corruption without --check goes unnoticed (exit {rc}): the check is what catches it")

    # The time split: measured per step and rank; contiguous causal work is imbalanced, zigzag is not.
    # At P = 2 contiguous, rank 1 computes a causal diagonal block and a full block, rank 0 only a diagonal
    # one: about a third of the step time is waiting for rank 1; zigzag balances it. Another process on the
    # machine adds imbalance of its own to whichever rank shares its core (ranks are bound to cores for
    # P <= 2: unbound with Open MPI, so the scheduler spreads it), so the pair is measured up to 4 times.
    unbind = ("--bind-to", "none") if open_mpi_4() else ()

    def split_run(layout, first):
        js = os.path.join(d, f"split_{layout}.json")
        rc, log = run(2, "--generate", "--seqlen", 8192, "--heads", 2, "--head-dim", 64, "--causal", "--layout", layout,
                      "--json", js, timeout=120, launcher=unbind)
        r = json.load(open(js)) if rc == 0 else {}
        parts = sum(r.get(x, 0) for x in ("step_compute_s", "load_imbalance_s", "communication_not_hidden_s"))
        ok = rc == 0 and "steps_s" in r and r["steps_s"] > 0 \
            and abs(parts - r["steps_s"]) <= 1e-6 + 1e-6 * r["steps_s"] \
            and min(r["step_compute_s"], r["load_imbalance_s"], r["communication_not_hidden_s"]) >= 0 and \
            r["transfer_s"] > 0 and r["exchange_alone_s"] > 0 and 0 <= r["communication_hidden"] <= 1 and \
            "load imbalance" in log and "communication not hidden" in log and "communication hidden" in log
        if first:
            check(ok, f"time split, P=2 {layout}: compute + imbalance + not hidden = ring steps, transfers measured, "
                      f"hidden in [0, 1] (exit {rc})")
        if not ok:
            print(log, r)
        return r if ok else None

    tries = []
    for t in range(4):
        c, z = split_run("contiguous", t == 0), split_run("zigzag", t == 0)
        if not c or not z:
            break
        tries.append((c["load_imbalance_s"], c["steps_s"], z["load_imbalance_s"]))
        if c["load_imbalance_s"] > 0.15 * c["steps_s"] and z["load_imbalance_s"] < 0.5 * c["load_imbalance_s"]:
            break
    if tries:
        ci, cs, zi = tries[-1]
        check(ci > 0.15 * cs and zi < 0.5 * ci,
              f"time split: causal contiguous waits for the slowest rank ({ci:.3f} of {cs:.3f} s), zigzag much less "
              f"({zi:.3f} s; {len(tries)} tr{'y' if len(tries) == 1 else 'ies'}: "
              f"{', '.join(f'{a:.3f}/{b:.3f}/{c:.3f}' for a, b, c in tries)})")
    js = os.path.join(d, "p1.json")
    rc, log = run(1, *GEN, "--json", js, timeout=60)
    r = json.load(open(js)) if rc == 0 else {}
    check(rc == 0 and "communication hidden n/a" in log and "communication_hidden" in r
          and r["communication_hidden"] is None and r.get("transfer_s") == 0,
          f"P=1: nothing sent, hidden is n/a (report) and null (JSON), not 100% (exit {rc})")

    # Attributes: typed as apps/README.md documents, the scale applied, versions present.
    table, readme = documented_attributes()
    kinds = {"integer": np.integer, "float": np.floating, "boolean": np.bool_, "string": str}
    for args, want_scale, extra_attrs in (((*GEN, "--backward"), 0.25, {"seed", "do_source"}),
                                          (("--input", with_do, "--scale", 0.3, "--window", 7, -1), 0.3, set())):
        out = os.path.join(d, "attrs.h5")
        rc, log = run(2, *args, "--output", out, "--check", 1, timeout=120)
        if rc != 0:
            check(False, f"attributes: exit {rc}")
            print(log)
            continue
        with h5py.File(out, "r") as f:
            attrs = dict(f.attrs)
        undocumented = sorted(set(attrs) - set(table))
        wrong = sorted(n for n, x in attrs.items() if n in table and not isinstance(x, kinds.get(table[n], ())))
        always = {n for n in table if n not in ("seed", "do_source")}
        missing = sorted((always | extra_attrs) - set(attrs))
        check(table and not undocumented and not wrong and not missing,
              f"attributes ({' '.join(map(str, args[:2]))}...): all documented in apps/README.md, typed as documented "
              f"(undocumented {undocumented}, wrong type {wrong}, missing {missing})")
        scale = attrs.get("scale")
        check(isinstance(scale, np.floating) and abs(scale - want_scale) < 1e-12 and attrs.get("ranks") == 2
              and attrs.get("check_rows") == 2
              and isinstance(attrs.get("causal"), np.bool_) and attrs.get("kfa_version") and attrs.get("mpi_version")
              and attrs.get("kokkos_version"),
              f"attributes: scale {attrs.get('scale')} is the one applied ({want_scale}), ranks 2, versions set")
        if "--window" in args:
            check(attrs.get("window_left") == 7 and attrs.get("window_right") == -1, "attributes: window_left/right")
    check("--oversubscribe" in readme and "N >= 2P" in readme and "N >= P" in readme,
          "apps/README.md documents --oversubscribe and N >= P (contiguous) / N >= 2P (zigzag)")


def collective_metadata(tmp):
    """Issue 15, items 4 and 8: what only rank 0 used to look at (links, types, shapes, a failed read on one
    rank) is decided by every rank: a valid external link works at P = 2, a dangling one, a corrupted
    gzip chunk in rank 1's rows, a group or a dangling soft link in place of a dataset, a truncated file and
    a complex 'do' end with one clear message (exit 2) within 30 s, never a hang."""
    d = os.path.join(tmp, "metadata")
    os.makedirs(d)
    rng = np.random.default_rng(11)
    b, s, h, dd = 1, 64, 2, 16
    q, k, v, do = (rng.standard_normal((b, s, h, dd)).astype(np.float32) for _ in range(4))
    o_ref = reference(q, k, v, do, causal=False)[0]

    def write(path, **extra):
        with h5py.File(path, "w") as f:
            for name, x in (("q", q), ("k", k), ("v", v)):
                if name not in extra:
                    f[name] = x
            for name, x in extra.items():
                if x is not None:
                    f[name] = x
        return path

    with h5py.File(os.path.join(d, "ext.h5"), "w") as f:
        f["v"] = v
    cases = []
    # A valid external link: rank 0 alone followed it and waited in MPI_Comm_dup while rank 1 sat in MPI_Bcast.
    linked = write(os.path.join(d, "linked.h5"), v=h5py.ExternalLink("ext.h5", "/v"))
    out = os.path.join(d, "linked_out.h5")
    rc, log = run(2, "--input", linked, "--output", out, "--check", 2, timeout=30, cwd=d)
    ok = rc == 0 and os.path.exists(out)
    if ok:
        with h5py.File(out, "r") as f:
            ok = rel(f["o"][...], o_ref) <= 1e-5
    check(ok, f"metadata: 'v' an external link to a valid dataset, 2 ranks: exit {rc} (want 0), o correct: {ok}")
    if rc != 0:
        print(log)

    # Dangling links, a group for 'q': the message names the dataset and the link's target, not "rank 0".
    cases.append(("'v' a dangling external link",
                  write(os.path.join(d, "dangling.h5"), v=h5py.ExternalLink("gone.h5", "/v")), (),
                  ("'v'", "gone.h5", "external link")))
    cases.append(("'q' a dangling soft link", write(os.path.join(d, "soft.h5"), q=h5py.SoftLink("/nothere")),
                  (), ("'q'", "/nothere")))
    grp = write(os.path.join(d, "group.h5"), q=None)
    with h5py.File(grp, "a") as f:
        f.create_group("q")
    cases.append(("'q' a group", grp, (), ("'q'", "is a group")))

    # A corrupted gzip chunk in rank 1's rows (contiguous layout: rows 32..63): the read fails on rank 1 only.
    bad = os.path.join(d, "corrupt.h5")
    with h5py.File(bad, "w") as f:
        f["q"], f["k"] = q, k
        f.create_dataset("v", data=v, chunks=(1, 8, h, dd), compression="gzip")
    with h5py.File(bad, "r") as f:
        info = [f["v"].id.get_chunk_info(i) for i in range(f["v"].id.get_num_chunks())]
    chunk = [c for c in info if c.chunk_offset[1] == 48][0]
    with open(bad, "r+b") as f:
        f.seek(chunk.byte_offset)
        f.write(b"\xff" * chunk.size)
    cases.append(("a corrupted gzip chunk in rank 1's rows of 'v'", bad, (), ("'v'", "32..63", "reading")))

    # A truncated file, an empty one, a text file: "not an HDF5 file or truncated".
    good = write(os.path.join(d, "good.h5"))
    data = open(good, "rb").read()
    for what, cut in (("truncated to half", len(data) // 2), ("truncated to 100 bytes", 100), ("empty", 0)):
        p = os.path.join(d, f"cut_{cut}.h5")
        with open(p, "wb") as f:
            f.write(data[:cut])
        cases.append((f"a file {what}", p, (), ("not an HDF5 file or truncated",)))

    # A complex 'do' is refused by its type, like q, k and v.
    cplx = write(os.path.join(d, "complex_do.h5"), do=(do + 1j * do).astype(np.complex64))
    cases.append(("a complex 'do'", cplx, ("--backward",), ("'do'", "compound", "not float64, float32 or float16")))
    cplx_q = write(os.path.join(d, "complex_q.h5"), q=(q + 1j * q).astype(np.complex64))
    cases.append(("a complex 'q'", cplx_q, (), ("'q'", "compound", "not float64, float32 or float16")))

    for what, path, extra, frags in cases:
        out = os.path.join(d, "out.h5")
        rc, log = run(2, "--input", path, "--output", out, *extra, timeout=30, cwd=d)
        said = all(f in log for f in frags)
        check(rc == 2 and said and "rank 0" not in log and not os.path.exists(out) and not temporaries(d),
              f"metadata: {what}, 2 ranks: exit {rc} (want 2, not a hang: 124) within 30 s, names {frags}: {said}")
        if rc != 2 or not said:
            print(log[-3000:])


def sizes_and_options(tmp):
    """Issue 15, items 6 and 7: impossible sizes are refused before anything is allocated, naming the shape,
    the bytes and the limit (c8edcdf: std::bad_alloc + MPI_ABORT, or 16 s of growing memory first); element
    counts beyond 64 bits are refused; generate-only options with --input and a negative seed are errors."""
    d = os.path.join(tmp, "sizes")
    os.makedirs(d)

    def declared(name, shape):  # datasets with a shape only: chunked, nothing written (a few KiB on disk)
        p = os.path.join(d, name)
        with h5py.File(p, "w") as f:
            for n in "qkv":
                f.create_dataset(n, shape=shape, dtype=np.float32, chunks=(1, 64, shape[2], shape[3]))
        return p

    cases = [
        ("file declaring seq 2^31", ("--input", declared("seq31.h5", (1, 2**31, 4, 64))),
         ("seq 2147483648", "bytes per rank", "MemAvailable")),
        ("file declaring batch 2^40", ("--input", declared("batch40.h5", (2**40, 64, 4, 64))),
         ("batch 1099511627776", "bytes per rank", "MemAvailable")),
        ("file declaring 2^40 x 2^22 x 4 x 64 elements (beyond 64 bits)",
         ("--input", declared("overflow.h5", (2**40, 2**22, 4, 64))), ("batch 1099511627776", "overflows 64-bit")),
        ("--generate --seqlen 2^31", ("--generate", "--seqlen", 2**31),
         ("seq 2147483648", "bytes per rank", "MemAvailable")),
        ("--generate --batch 1000000000", ("--generate", "--batch", 1000000000), ("batch 1000000000", "MemAvailable")),
        ("--generate --batch 1e9", ("--generate", "--batch", "1e9"), ("--batch", "1e9")),
        ("--check 2000000000", ("--generate", "--seqlen", 256, "--check", 2000000000),
         ("--check 2000000000", "bytes", "MemAvailable")),
        ("--generate --batch 2^62 (count beyond 64 bits)", ("--generate", "--batch", 2**62, "--seqlen", 4),
         ("batch 4611686018427387904", "overflows 64-bit")),
    ]
    out = os.path.join(d, "out.h5")
    for what, args, frags in cases:
        t0 = time.time()
        rc, log = run(2, *args, "--output", out, timeout=30)
        secs = time.time() - t0
        said = all(f in log for f in frags)
        check(rc == 2 and said and secs < 20 and "bad_alloc" not in log and "MPI_ABORT" not in log
              and not os.path.exists(out),
              f"sizes: {what}: exit {rc} (want 2) in {secs:.1f} s (< 20), names {frags}: {said}")
        if rc != 2 or not said:
            print(log[-3000:])

    good = os.path.join(d, "good.h5")
    with h5py.File(good, "w") as f:
        for n in "qkv":
            f[n] = np.ones((1, 64, 2, 16), np.float32)
    for opt, val in (("--seqlen", 100), ("--heads", 8), ("--kv-heads", 1), ("--head-dim", 32), ("--batch", 2),
                     ("--seed", 3)):
        rc, log = run(2, "--input", good, opt, val)
        said = f"{opt} applies only with --generate" in log
        check(rc == 2 and said and "TFLOP/s" not in log,
              f"options: {opt} with --input: exit {rc} (want 2), says so: {said}")
    for bad in ("-5", "abc"):
        rc, log = run(1, "--generate", "--seqlen", 64, "--seed", bad)
        check(rc == 2 and "--seed" in log and bad in log and "TFLOP/s" not in log,
              f"options: --seed {bad}: exit {rc} (want 2)")


def full_filesystem(d):
    """A full file system (a small tmpfs, mounted when run as root): the old output and JSON stay
    byte-identical, no temporary is left, the run ends non-zero with 'no space left on device' within 60 s on
    every rank, without a crash (c8edcdf: a segfault, exit 139, in MPI_Finalize; hangs at P >= 2 per issue 15)."""
    if os.geteuid() != 0:
        print("skip full file system cases: not root (they mount a 2 MiB tmpfs)")
        return
    fs = os.path.join(d, "fs")
    os.makedirs(fs)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", fs], capture_output=True).returncode != 0:
        print("skip full file system cases: mount -t tmpfs failed")
        return
    try:
        out = os.path.join(fs, "out.h5")
        js = os.path.join(fs, "summary.json")
        rc, log = run(1, *GEN, "--output", out, "--json", js)
        check(rc == 0, f"full fs: a good run first (exit {rc})")
        if rc != 0:
            print(log)
            return
        hashes = {p: sha256(p) for p in (out, js)}
        fill = os.path.join(fs, "fill")

        def fill_up(leave_kib):
            if os.path.exists(fill):
                os.remove(fill)
            st = os.statvfs(fs)
            n = max(0, st.f_bavail * st.f_frsize - leave_kib * 1024)
            with open(fill, "wb", buffering=0) as f:
                try:
                    f.write(b"\0" * n)
                    if leave_kib == 0:
                        while True:
                            f.write(b"\0" * 4096)
                            f.flush()
                except OSError:
                    pass

        # Full to the last block; and 200 KiB left, less than the 512 KiB output of seq 4096.
        big = ("--generate", "--seqlen", 4096, "--heads", 2, "--head-dim", 16)
        for leave, args, what in ((0, GEN, "full"), (200, big, "200 KiB free")):
            for nranks in (1, 2, 3):
                cases = [(("--output", out, "--json", js), "--output and --json")]
                if leave == 0:
                    cases.append((("--json", js), "--json only"))
                for outputs, label in cases:
                    fill_up(leave)
                    rc, log = run(nranks, *args, *outputs, timeout=60)
                    kept = all(sha256(p) == h for p, h in hashes.items())
                    said = "no space left on device" in log.lower()
                    crashed = rc in (124, 134, 139) or rc < 0 or "Segmentation fault" in log or "signal" in log.lower()
                    check(rc not in (0, 124) and not crashed and kept and said and not temporaries(fs),
                          f"full fs ({what}), {label}, {nranks} rank(s): exit {rc}, no crash/hang: {not crashed}, "
                          f"old files byte-identical: {kept}, says no space: {said}, "
                          f"no temporary left: {not temporaries(fs)}")
                    if rc == 0 or crashed or not said:
                        print(log[-3000:])
    finally:
        subprocess.run(["umount", fs])


def full_after_reservation(d):
    """Issue 15 residual: a disk that another process fills *after* the output's space was reserved (the
    KFA_LONGSEQ_FILL_AFTER_RESERVE test hook fills a small tmpfs right after the Writer reserved, before any
    dataset is written; root only, it mounts the tmpfs). Before the fix the reservation was a separate file
    given back at once: HDF5's collective write then hit ENOSPC in one Open MPI aggregator and the others
    waited for it, a hang at P = 3 (P = 1, 2 ended with exit 2). Now the temporary owns its blocks: the HDF5
    output is written completely at any P, equal to the same run on a roomy disk. Without fallocate (the
    KFA_IO_NO_FALLOCATE test hook) the datasets are written with independent MPI-IO: exit 2 on every rank,
    the message names the file and the error, the old output stays byte-identical, nothing is left, no hang.
    Every run has a 60 s limit, so a hang fails instead of blocking. (A --json on a full disk: full_filesystem.)"""
    if os.geteuid() != 0:
        print("skip full-after-reservation cases: not root (they mount a 4 MiB tmpfs)")
        return
    fs = os.path.join(d, "fs_after")
    os.makedirs(fs)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", fs], capture_output=True).returncode != 0:
        print("skip full-after-reservation cases: mount -t tmpfs failed")
        return
    try:
        out = os.path.join(fs, "out.h5")
        js = os.path.join(fs, "summary.json")
        fill = os.path.join(fs, "fill")
        rc, log = run(1, *GEN, "--output", out, "--json", js)
        check(rc == 0, f"full after reservation: a good run first (exit {rc})")
        if rc != 0:
            print(log)
            return
        hashes = {p: sha256(p) for p in (out, js)}
        # 512 KiB of o in blocks of 3000 elements: many collective writes, every rank an aggregator.
        big = ("--generate", "--seqlen", 4096, "--heads", 2, "--head-dim", 16, "--layout", "zigzag")
        chunk = {"KFA_LONGSEQ_IO_CHUNK": "3000"}
        for nranks in (1, 2, 3):
            want = {}
            ref = os.path.join(d, f"after_ref_{nranks}.h5")
            rc, log = run(nranks, *big, "--output", ref, timeout=60, env=chunk)
            check(rc == 0, f"full after reservation: the same run on a roomy disk, {nranks} rank(s) (exit {rc})")
            if rc == 0:
                with h5py.File(ref, "r") as f:
                    want = {k: f[k][...] for k in ("o", "lse")}
            for hook, outputs, label in (("", ("--output", os.path.join(fs, "new.h5")), "fallocate, --output"),
                                         ("1", ("--output", out, "--json", js), "no fallocate, --output and --json")):
                for x in (fill, os.path.join(fs, "new.h5")):
                    if os.path.exists(x):
                        os.remove(x)
                env = dict(chunk, KFA_LONGSEQ_FILL_AFTER_RESERVE=fill, KFA_IO_NO_FALLOCATE=hook)
                t0 = time.time()
                rc, log = run(nranks, *big, *outputs, timeout=60, env=env)
                took = time.time() - t0
                filled = os.path.exists(fill) and os.path.getsize(fill) > 0  # the hook wrote until ENOSPC
                kept = all(sha256(p) == h for p, h in hashes.items())
                crashed = rc in (124, 134, 139) or rc < 0 or "Segmentation fault" in log or "signal" in log.lower()
                left = temporaries(fs)
                tag = f"full after reservation, {label}, {nranks} rank(s)"
                if outputs[1] != out:  # the output owns its blocks: written whole although the disk is full
                    same = False
                    if rc == 0 and want:
                        with h5py.File(outputs[1], "r") as f:
                            same = all(np.array_equal(f[k][...], v) for k, v in want.items())
                    check(rc == 0 and filled and same and kept and not left,
                          f"{tag}: exit {rc} in {took:.1f} s (want 0), disk filled: {filled}, output equal to the "
                          f"reference: {same}, no temporary left: {not left}")
                else:
                    said = "no space left on device" in log.lower()
                    named = f"--output {out}: writing dataset" in log
                    check(rc == 2 and not crashed and filled and said and named and kept and not left,
                          f"{tag}: exit {rc} in {took:.1f} s (want 2), no crash/hang: {not crashed}, disk filled: "
                          f"{filled}, says no space: {said}, names the file: {named}, "
                          f"old files byte-identical: {kept}, no temporary left: {not left}")
                if rc not in (0, 2) or crashed:
                    print(log[-3000:])
    finally:
        subprocess.run(["umount", fs])


def ring_faults(tmp):
    """Chunked ring messages give the same checked result; a failure on one rank in the middle of the ring
    (the KFA_RING_FAULT test hook of kfa::dist::Ring) ends every rank with the same error, exit 2, no hang and no
    output file."""
    base = ["--generate", "--seqlen", 384, "--heads", 2, "--head-dim", 32, "--causal", "--layout", "zigzag",
            "--backward"]
    out = os.path.join(tmp, "chunked.h5")
    rc, log = run(2, *base, "--check", 3, "--max-message-bytes", 1000, "--output", out, timeout=120)
    check(rc == 0 and "PASS" in log and "messages of at most 1000 bytes" in log,
          "ring messages in 1000-byte chunks: exit 0, check passes, reported")
    if rc != 0:
        print(log)
    for bad in ("0", "-1", "abc", "3000000000"):
        rc, log = run(1, *base, "--max-message-bytes", bad, timeout=60)
        check(rc == 2 and "--max-message-bytes" in log, f"--max-message-bytes {bad} refused with exit 2")
    fdir = os.path.join(tmp, "faults")
    os.makedirs(fdir, exist_ok=True)
    for hook in ("1:1", "0:0", "1:0"):
        out = os.path.join(fdir, f"fault_{hook.replace(':', '_')}.h5")
        os.environ["KFA_RING_FAULT"] = hook
        try:
            rc, log = run(2, *base, "--output", out, timeout=60)
        finally:
            del os.environ["KFA_RING_FAULT"]
        r, st = hook.split(":")
        want = f"ring step {st}: rank {r} of 2: kfa::dist: fault injected"
        check(rc == 2 and want in log and not os.path.exists(out) and not temporaries(fdir),
              f"fault at rank {r}, step {st}: exit 2 on every rank (got {rc}), the same message, no output, no hang")
        if rc != 2 or want not in log:
            print(log)


def nonfinite(tmp):
    """NaN in k is refused (exit 2, naming 'k', its count and --allow-nonfinite) before any work; with
    --allow-nonfinite it runs, reports the counts and writes; finite inputs whose scores overflow float32 give
    exit 4 with the hint and no output (the old output kept), and succeed in float64."""
    d = os.path.join(tmp, "nonfinite")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng()
    b, s, h, dd = 1, 96, 2, 16
    q, k, v = (rng.standard_normal((b, s, h, dd)) for _ in range(3))
    for np_ in (1, 2):
        for pos, what in (((0, 0, 0, 0), "first"), ((0, s - 1, h - 1, dd - 1), "last"), ((0, 50, 1, 7), "middle")):
            kk = k.copy()
            kk[pos] = np.nan
            kk[0, 3, 0, 2] = np.inf if what != "first" else -np.inf
            inp = os.path.join(d, f"nan_k_{what}.h5")
            with h5py.File(inp, "w") as f:
                f["q"], f["k"], f["v"] = q.astype(np.float32), kk.astype(np.float32), v.astype(np.float32)
            out = os.path.join(d, f"nan_k_{what}_{np_}.h5")
            rc, log = run(np_, "--input", inp, "--output", out, timeout=120)
            check(rc == 2 and "'k'" in log and "has 2" in log and "--allow-nonfinite" in log and not os.path.exists(out)
                  and "'q'" not in log and not temporaries(d),
                  f"P={np_}: NaN ({what}) and Inf in k refused: exit 2 (got {rc}) naming 'k' and its count, no output")
            if rc != 2:
                print(log)
            js = os.path.join(d, f"nan_k_{what}_{np_}.json")
            rc, log = run(np_, "--input", inp, "--output", out, "--json", js, "--allow-nonfinite", timeout=120)
            rep = json.load(open(js)) if os.path.exists(js) else {}
            ok = (rc == 0 and os.path.exists(out) and "non-finite values: inputs q 0, k 2, v 0" in log
                  and rep.get("nonfinite_inputs") == {"q": 0, "k": 2, "v": 0}
                  and rep.get("nonfinite_outputs", {}).get("o", 0) > 0)
            if ok:
                with h5py.File(out, "r") as f:
                    ok = bool(np.isnan(f["o"][...]).any())
            check(ok, f"P={np_}: NaN ({what}) in k with --allow-nonfinite: exit 0 (got {rc}), counts reported and in "
                      "the JSON, NaN o written")
            if not ok:
                print(log)
    # NaN in q (and in do with --backward) named the same way.
    qq = q.copy()
    qq[0, 10, 1, 3] = np.nan
    inp = os.path.join(d, "nan_q.h5")
    with h5py.File(inp, "w") as f:
        f["q"], f["k"], f["v"] = qq, k, v
        dob = rng.standard_normal((b, s, h, dd))
        dob[0, s - 1, 0, 0] = np.inf
        f["do"] = dob
    rc, log = run(2, "--input", inp, "--backward", timeout=120)
    check(rc == 2 and "'q'" in log and "[0, 10, 1, 3]" in log and "'do'" in log and "[0, 95, 0, 0]" in log,
          f"NaN in q and Inf in do (--backward) refused naming both and their first elements (exit {rc})")
    if rc != 2:
        print(log)
    # Finite inputs, scores beyond float32: exit 4, the hint, the old output byte-identical, no temporaries.
    big = os.path.join(d, "big.h5")
    with h5py.File(big, "w") as f:
        # ~1e20: q.k ~ 1e40 overflows float32 but not float64 (continuous values: no near-ties for ulps to decide)
        f["q"], f["k"] = (q * 2.0 ** 66).astype(np.float32), (k * 2.0 ** 66).astype(np.float32)
        f["v"] = v.astype(np.float32)
    out = os.path.join(d, "big_out.h5")
    with open(out, "wb") as f:
        f.write(b"previous good output")
    before = sha256(out)
    for np_ in (1, 2):
        rc, log = run(np_, "--input", big, "--dtype", "float32", "--output", out, "--json", out + ".json", timeout=120)
        check(rc == 4 and "use --dtype float64 or a smaller --scale" in log and "o " in log and sha256(out) == before
              and not os.path.exists(out + ".json") and not temporaries(d),
              f"P={np_}: float32 score overflow: exit 4 (got {rc}) with the hint, old output kept, no JSON")
        if rc != 4:
            print(log)
    rc, log = run(2, "--input", big, "--dtype", "float32", "--backward", timeout=120)
    check(rc == 4 and "dq " in log, f"float32 overflow with --backward: exit 4 (got {rc}), gradients counted")
    rc, log = run(2, "--input", big, "--dtype", "float32", "--allow-nonfinite", "--output", out, timeout=120)
    check(rc == 0 and "non-finite values: inputs q 0, k 0, v 0; outputs o " in log and sha256(out) != before,
          f"float32 overflow with --allow-nonfinite: exit 0 (got {rc}), counts reported, written")
    out64 = os.path.join(d, "big_out64.h5")
    rc, log = run(2, "--input", big, "--dtype", "float64", "--output", out64, "--check", 4, timeout=120)
    ok = rc == 0 and "PASS" in log and os.path.exists(out64) and "non-finite" not in log
    if ok:
        with h5py.File(out64, "r") as f:
            ok = bool(np.isfinite(f["o"][...]).all() and np.isfinite(f["lse"][...]).all())
    check(ok, f"the same input in float64: exit 0 (got {rc}), finite o and lse, check passes")
    if not ok:
        print(log)
    # Values beyond float32's range become Inf when rounded to the compute dtype: refused as inputs.
    huge = os.path.join(d, "huge.h5")
    with h5py.File(huge, "w") as f:
        qh = q.copy()
        qh[0, 0, 0, 0] = 1e300
        f["q"], f["k"], f["v"] = qh, k, v
    rc, log = run(1, "--input", huge, "--dtype", "float32", timeout=120)
    check(rc == 2 and "'q'" in log and "float32" in log, f"1e300 in float64 q with --dtype float32: exit 2 (got {rc})")
    rc, log = run(1, "--input", huge, "--dtype", "float64", timeout=120)
    check(rc in (0, 4), f"the same in float64 is accepted as input (exit {rc})")


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
                check(f.attrs["ranks"] == nranks and isinstance(f.attrs["ranks"], np.integer),
                      f"{tag}: ranks attribute")
                check(rel(f["o"][...], o_ref) <= tol, f"{tag}: o error {rel(f['o'][...], o_ref):.2e} <= {tol}")
                check(rel(f["lse"][...], lse_ref) <= tol, f"{tag}: lse error {rel(f['lse'][...], lse_ref):.2e}")
                for name, ref in (("dq", dq_ref), ("dk", dk_ref), ("dv", dv_ref)):
                    e = rel(f[name][...], ref)
                    check(e <= tol, f"{tag}: {name} error {e:.2e} <= {tol}")
            with open(js) as f:
                summary = json.load(f)
            g = summary["check"]["gradients"]
            check(summary["check"]["pass"] and summary["ranks"] == nranks and g["key_rows"] == 3 * nranks
                  and max(g["dq_rel_error"], g["dk_rel_error"], g["dv_rel_error"]) <= 10 * tol, f"{tag}: JSON summary")
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
    check(rc == 2 and "/nonexistent_dir" in log and "does not exist" in log, "missing output directory")

    output_safety(tmp)
    long_names_and_debris(tmp)
    help_and_progress(tmp)
    reports_and_attributes(tmp)
    collective_metadata(tmp)
    sizes_and_options(tmp)
    full_after_reservation(tmp)
    ring_faults(tmp)
    nonfinite(tmp)

    # A failed or killed run never replaces a good output file, and never leaves a partial one.
    keep = os.path.join(tmp, "keep.h5")
    rc, _ = run(2, "--generate", "--seqlen", 128, "--heads", 2, "--head-dim", 16, "--output", keep)
    before = open(keep, "rb").read() if rc == 0 else b""
    rc2, _ = run(2, "--input", no_v, "--output", keep)
    check(rc == 0 and rc2 != 0 and open(keep, "rb").read() == before, "failed run leaves the existing output intact")
    killed = os.path.join(tmp, "killed.h5")
    cmd = MPI[:1] + ["-n", "2"] + MPI[1:] + [APP, "--generate", "--seqlen", "262144", "--heads", "8", "--head-dim",
                                             "64", "--output", killed]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                         env=mpi_env())
    err, t0 = b"", time.time()  # killed while computing: once the start line is out (a fixed 3 s before: slower)
    while b"computing" not in err and p.poll() is None and time.time() - t0 < 60:
        if select.select([p.stderr], [], [], 1)[0]:
            err += os.read(p.stderr.fileno(), 4096)
    time.sleep(0.5)
    kill_session(p.pid)  # mpirun and the ranks (killpg(mpirun) left the ranks computing, orphaned)
    p.wait()
    p.stderr.close()
    check(b"computing" in err and not os.path.exists(killed), "killed run (while computing) leaves no output file")

    return apptest.finish()


if __name__ == "__main__":
    sys.exit(main())
