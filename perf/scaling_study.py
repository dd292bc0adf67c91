#!/usr/bin/env python3
"""Scaling study of kfa-longseq: runs the app (each run with --json) over a grid of rank counts and sequence
lengths, repeats every configuration, and writes CSV files, PNG plots and meta.json into --out:

  strong.csv/png   fixed N, P = 1, 2, 4, ...: compute time and speed-up
  weak.csv/png     fixed tokens per rank: per-rank TFLOP/s and efficiency
  causal.csv/png   causal attention, contiguous vs zigzag sharding
  memory.csv/png   memory vs N on 1 rank: kfa-longseq's process high-water, and kfa's and the materialized
                   reference's extra allocations as kfa_bench_forward measures them (the reference stores N x N)
  speed.csv/png    TFLOP/s vs N on 1 rank
  strategies.csv   with --strategies: forward+backward, causal, zigzag, at --strong-seq: the ring, Ulysses, every
                   hybrid degree and --sp auto's choice side by side at each rank count above 1 (no plot)
  meta.json        machine, backend, host ISA, date, command line, grid

  /usr/bin/python3 perf/scaling_study.py --build build --out perf/study [--ranks 1,2,4] [--reps 3] [--quick]

Every CSV row comes from ONE run: of the --reps runs of a configuration (interleaved: repetition r of every
configuration runs before repetition r+1 of any), the row is the run with the median compute time (for an
even count the faster of the middle two); *_min / *_max columns are the fastest and slowest runs, drawn as
error bars. tflops = 4 * batch * heads * N^2 * head_dim (x 0.5 causal) / compute_s of that same run (the
app's own tflops is cross-checked against it; with --doc-lognormal, a mix of document lengths packed into every
sequence, the app's own tflops, which counts Σ L² over the documents). Ratios (speed-up, efficiency) divide the median rows, their
bars the extremes. other_cores_busy: CPU the rest of the machine used during that run (busy CPU seconds from
/proc/stat less this study's own, per second of wall time): a slow outlier's usual cause on a shared machine.

From each run's --json it reads compute_s and memory_high_water_mib (required), tflops (cross-check), backend,
kokkos_version, kfa_version, host ISA when present, and copies every other numeric *_s field and
communication_hidden into the CSVs. The host ISA otherwise comes from kfa_bench_forward's "# host SIMD" line.

Plots need matplotlib (Debian: python3-matplotlib; /usr/bin/python3 when another python3 comes first on PATH);
--no-plots writes the CSV files and meta.json only. With Open MPI the runs get --oversubscribe (and
--allow-run-as-root as root); the plots mark rank counts above the cores only when the grid has them. With an
OpenMP build each rank gets OMP_NUM_THREADS = cores / ranks unless OMP_NUM_THREADS is set.
"""
import argparse
import csv
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

DEVICE_BACKENDS = ("Cuda", "HIP", "SYCL", "OpenMPTarget")


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown CPU"


def gpu_names():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    names = [l.strip() for l in out.splitlines() if l.strip()]
    if not names:
        return ""
    return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)


def busy_cpu_s():
    """CPU seconds the whole machine has spent busy (user, nice, system, irq, softirq, steal) since boot."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def children_cpu_s():
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def mpiexec_command(a):
    cmd = shlex.split(a.mpiexec)
    if a.mpiexec_flags is not None:
        return cmd + shlex.split(a.mpiexec_flags)
    try:
        version = subprocess.run(cmd + ["--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        sys.exit(f"scaling_study.py: cannot run {a.mpiexec}: {e}")
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


def source_commit():
    """The commit of the tree this script sits in ("+ local changes" when dirty): what the build was made from,
    if it was built from this tree."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        c = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return ""
    return c + (" + local changes" if c and dirty else "")


class Study:
    def __init__(self, a):
        self.a = a
        self.app = os.path.join(a.build, "apps/kfa-longseq/kfa-longseq")
        if not os.access(self.app, os.X_OK):
            sys.exit(f"scaling_study.py: {self.app} not found: build it first (cmake --build {a.build} --target kfa-longseq)")
        self.mpiexec = mpiexec_command(a)
        self.tmp = tempfile.mkdtemp(prefix="kfa_study_")
        self.first = None  # the first run's JSON: backend, versions
        self.count, self.total, self.t0 = 0, 0, time.time()

    def flops(self, seq, causal):
        return 4.0 * self.a.batch * self.a.heads * float(seq) * seq * self.a.head_dim * (0.5 if causal else 1.0)

    def run(self, p, seq, causal, layout, sp=None):
        a = self.a
        js = os.path.join(self.tmp, "run.json")
        if os.path.exists(js):
            os.remove(js)
        cmd = self.mpiexec + ["-n", str(p), self.app, "--generate", "--batch", str(a.batch), "--seqlen", str(seq),
                              "--heads", str(a.heads), "--head-dim", str(a.head_dim), "--dtype", a.dtype,
                              "--layout", layout, "--json", js] + (["--causal"] if causal else []) + \
            (["--doc-lognormal"] + a.doc_lognormal.split(",") if a.doc_lognormal else []) + \
            (["--backward"] if sp else []) + (shlex.split(sp) if sp else [])
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores() // p)))
        self.count += 1
        print(f"[{self.count}/{self.total}, {time.time() - self.t0:.0f} s] " + " ".join(cmd), flush=True)
        # stdout (the report) and stderr (progress lines) are kept and shown only when the run fails
        busy0, ours0, wall0 = busy_cpu_s(), children_cpu_s(), time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        others = max(0.0, (busy_cpu_s() - busy0) - (children_cpu_s() - ours0)) / max(time.time() - wall0, 1e-9)
        if r.returncode != 0 or not os.path.exists(js):
            sys.exit(f"scaling_study.py: exit {r.returncode}: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        with open(js) as f:
            j = json.load(f)
        os.remove(js)
        for key in ("compute_s", "memory_high_water_mib"):
            if not isinstance(j.get(key), (int, float)):
                sys.exit(f"scaling_study.py: the app's --json has no number '{key}': {j}")
        for key, want in (("ranks", p), ("seq", seq)):
            if key in j and j[key] != want:
                sys.exit(f"scaling_study.py: asked for {key} {want}, the app's --json says {j[key]}")
        if self.first is None:
            self.first = j
        t = self.flops(seq, causal) / j["compute_s"] * 1e-12 * (3.5 if sp else 1.0)
        if a.doc_lognormal:  # documents: the app counts the pairs of each document (Σ L² instead of N²)
            t = j["tflops"]
        elif isinstance(j.get("tflops"), (int, float)) and abs(j["tflops"] - t) > 0.01 * t:
            print(f"  warning: the app reports {j['tflops']} TFLOP/s, its compute_s and the flop count give {t:.6g}",
                  flush=True)
        j["study_tflops"] = t
        j["other_cores_busy"] = round(others, 2)  # other work on the machine: the usual reason for a slow outlier
        return j

    def sweep(self, configs):
        """configs: {key: (p, seq, causal, layout)} -> {key: [json of each repetition]}, repetitions interleaved."""
        self.total += len(configs) * self.a.reps
        runs = {k: [] for k in configs}
        for _ in range(self.a.reps):
            for k, c in configs.items():
                runs[k].append(self.run(*c))
        return runs


def row(runs, p, seq, causal, layout, a, sp=None):
    """The CSV row of one configuration: every value from the median run, plus the extremes' compute_s."""
    ranked = sorted(runs, key=lambda j: j["compute_s"])
    m = ranked[(len(ranked) - 1) // 2]
    r = dict(ranks=p, seq=seq, dtype=m.get("dtype", a.dtype), causal=int(causal), layout=layout, batch=a.batch, heads=a.heads,
             head_dim=a.head_dim, reps=len(runs), compute_s=m["compute_s"], compute_s_min=ranked[0]["compute_s"],
             compute_s_max=ranked[-1]["compute_s"], tflops=float(f"{m['study_tflops']:.6g}"),
             tflops_min=float(f"{ranked[-1]['study_tflops']:.6g}"), tflops_max=float(f"{ranked[0]['study_tflops']:.6g}"))
    for k, v in m.items():  # the time split of that run, whatever the app reports
        if (k.endswith("_s") or k == "communication_hidden") and k not in r and isinstance(v, (int, float)) \
                and not isinstance(v, bool):
            r[k] = v
    if a.doc_lognormal:  # the mix this row ran: the app's count of documents and its longest
        r["documents"], r["longest_document"] = m.get("documents"), m.get("longest_document")
    if sp:  # strategies.csv: what ran (auto: the model's choice) and what was asked
        r["sp_asked"], r["sp"], r["ulysses_degree"] = sp, m.get("sp"), m.get("ulysses_degree")
        r["a2a_bytes"] = m.get("a2a_bytes")
    r["memory_high_water_mib"] = m["memory_high_water_mib"]
    r["other_cores_busy"] = m["other_cores_busy"]
    return r


def write_csv(path, rows):
    fields = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)


def bench_memory(a, lengths):
    """kfa_bench_forward (float, non-causal, d = --head-dim): {N: (kfa extra MiB, reference extra MiB)}, host ISA."""
    exe = os.path.join(a.build, "perf/kfa_bench_forward")
    ns = [n for n in lengths if n <= a.reference_max_n]
    if not os.access(exe, os.X_OK) or not ns:
        if ns:
            print(f"  {exe} not built: memory.csv without the bench columns, the ISA from the app's JSON only")
        return {}, ""
    cmd = [exe, "--n", ",".join(map(str, ns)), "--d", str(a.head_dim), "--heads", str(a.heads), "--reps", "1",
           "--gemm-n", "64", "--reference-max-n", str(a.reference_max_n)]
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"scaling_study.py: exit {r.returncode}: {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    isa, head, mem = "", None, {}
    for line in r.stdout.splitlines():
        if line.startswith("# host SIMD:"):
            isa = line.split(":", 1)[1].strip()
        elif not line.startswith("#") and "ref_MiB" in line.split():
            head = line.split()
        elif head and len(line.split()) == len(head):
            f = dict(zip(head, line.split()))
            if f["causal"] == "no" and int(f["d"]) == a.head_dim:
                mem[int(f["N"])] = (float(f["kfa_MiB"]), float(f["ref_MiB"]))
    if head is None:
        sys.exit(f"scaling_study.py: no table header (with ref_MiB) in the output of {' '.join(cmd)}:\n{r.stdout}")
    return mem, isa


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="build directory (default: %(default)s)")
    ap.add_argument("--out", default="perf/study", help="output directory (default: %(default)s)")
    ap.add_argument("--ranks", help="rank counts, comma separated (default: 1, 2, 4, ... up to --max-ranks)")
    ap.add_argument("--max-ranks", type=int, default=4, help="default: %(default)s")
    ap.add_argument("--reps", type=int, default=3, help="runs per configuration, the median reported (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=1, help="default: %(default)s")
    ap.add_argument("--heads", type=int, default=4, help="default: %(default)s")
    ap.add_argument("--head-dim", type=int, default=64, help="default: %(default)s")
    ap.add_argument("--dtype", default="float32", help="kfa-longseq --dtype (default: %(default)s)")
    ap.add_argument("--strong-seq", type=int, help="N of the strong-scaling and causal runs (default 32768; --quick 16384)")
    ap.add_argument("--per-rank", type=int, help="tokens per rank of the weak-scaling runs (default 16384; --quick 8192)")
    ap.add_argument("--lengths", help="N of the 1-rank memory/speed runs, comma separated "
                    "(default 512,2048,4096,16384,65536; --quick without 65536)")
    ap.add_argument("--reference-max-n", type=int, default=16384,
                    help="largest N given to kfa_bench_forward for the memory columns (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (minutes on 2 cores)")
    ap.add_argument("--strategies", action="store_true",
                    help="also strategies.csv: ring, Ulysses, hybrids and --sp auto side by side (forward+backward)")
    ap.add_argument("--doc-lognormal", metavar="MEDIAN,SIGMA,MIN,MAX,SEED",
                    help="a length mix: every run packs documents of these log-normal lengths into its sequence "
                         "(kfa-longseq --doc-lognormal; needs --batch 1); TFLOP/s then count each document's pairs")
    ap.add_argument("--mpiexec", default="mpirun", help="default: %(default)s")
    ap.add_argument("--mpiexec-flags", help="flags after MPIEXEC (default: with Open MPI --oversubscribe, and "
                    "--allow-run-as-root as root)")
    ap.add_argument("--machine", help="the machine in the captions (default: the CPU model or GPU name and the cores)")
    ap.add_argument("--no-plots", action="store_true", help="CSV files and meta.json only (no matplotlib needed)")
    a = ap.parse_args()
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    if a.doc_lognormal and (len(a.doc_lognormal.split(",")) != 5 or a.batch != 1):
        ap.error("--doc-lognormal takes MEDIAN,SIGMA,MIN,MAX,SEED and needs --batch 1")
    plt = None
    if not a.no_plots:  # before minutes of runs, not after
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            sys.exit("scaling_study.py: the plots need matplotlib (Debian: apt-get install python3-matplotlib, then run "
                     "with /usr/bin/python3), or pass --no-plots")
    try:
        ranks = sorted({int(x) for x in a.ranks.split(",")}) if a.ranks else \
            [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= a.max_ranks]
        lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else \
            [512, 2048, 4096, 16384] + ([] if a.quick else [65536])
    except ValueError as e:
        ap.error(f"--ranks/--lengths: {e}")
    if not ranks or ranks[0] < 1 or ranks[0] != 1:
        ap.error("--ranks must start at 1 (speed-up and efficiency are relative to one rank)")
    n_strong = a.strong_seq or (16384 if a.quick else 32768)
    per_rank = a.per_rank or (8192 if a.quick else 16384)
    too_short = [p for p in ranks if n_strong < 2 * p]
    if too_short:
        ap.error(f"--strong-seq {n_strong} is shorter than 2 x {too_short[0]} ranks (zigzag needs two chunks per rank)")
    os.makedirs(a.out, exist_ok=True)
    s = Study(a)
    date = datetime.date.today().isoformat()
    load_before, source = os.getloadavg(), source_commit()

    strong_c = {("strong", p): (p, n_strong, False, "contiguous") for p in ranks}
    weak_c = {("weak", p): (p, per_rank * p, False, "contiguous") for p in ranks}
    causal_c = {("causal", p, lay): (p, n_strong, True, lay) for p in ranks if p > 1 for lay in ("contiguous", "zigzag")}
    one_c = {("one", n): (1, n, False, "contiguous") for n in lengths}
    # --strategies: forward+backward, causal, zigzag, N = --strong-seq: the ring, Ulysses (heads permitting), every
    # hybrid degree, and the cost model's choice (auto), side by side
    sp_c = {}
    if a.strategies:
        for p in (p for p in ranks if p > 1):
            asked = ["--sp ring", "--sp auto"] + (["--sp ulysses"] if a.heads % p == 0 else []) + \
                [f"--sp hybrid --ulysses-degree {u}" for u in range(2, p) if p % u == 0 and a.heads % u == 0]
            for sp in asked:
                sp_c[("sp", p, sp)] = (p, n_strong, True, "zigzag", sp)
    try:
        runs = s.sweep({**strong_c, **weak_c, **causal_c, **one_c, **sp_c})
    finally:
        shutil.rmtree(s.tmp, ignore_errors=True)
    mem, bench_isa = bench_memory(a, lengths)

    strong = [row(runs[k], *c, a) for k, c in strong_c.items()]
    t1 = strong[0]["compute_s"]
    for r in strong:
        r["speedup"], r["speedup_min"], r["speedup_max"] = (round(t1 / r["compute_s"], 4), round(t1 / r["compute_s_max"], 4),
                                                            round(t1 / r["compute_s_min"], 4))
    weak = [row(runs[k], *c, a) for k, c in weak_c.items()]
    base = weak[0]["tflops"]
    for r in weak:
        p = r["ranks"]
        r["tflops_per_rank"] = float(f"{r['tflops'] / p:.6g}")
        r["efficiency"], r["efficiency_min"], r["efficiency_max"] = (round(r["tflops"] / p / base, 4),
                                                                     round(r["tflops_min"] / p / base, 4),
                                                                     round(r["tflops_max"] / p / base, 4))
    causal = [row(runs[k], *c, a) for k, c in causal_c.items()]
    one = [row(runs[k], *c, a) for k, c in one_c.items()]
    memory = [dict(seq=r["seq"], dtype=r["dtype"], batch=a.batch, heads=a.heads, head_dim=a.head_dim,
                   kfa_rank_high_water_mib=r["memory_high_water_mib"],
                   kfa_extra_mib=mem[r["seq"]][0] if r["seq"] in mem else "",
                   reference_extra_mib=mem[r["seq"]][1] if r["seq"] in mem else "") for r in one]
    speed = [{k: r[k] for k in ("seq", "dtype", "causal", "batch", "heads", "head_dim", "reps", "compute_s", "compute_s_min",
                                "compute_s_max", "tflops", "tflops_min", "tflops_max", "documents", "longest_document")
              if k in r} for r in one]
    strategies = [row(runs[k], *c[:4], a, sp=c[4]) for k, c in sp_c.items()]
    for name, rows in (("strong", strong), ("weak", weak), ("causal", causal), ("memory", memory), ("speed", speed),
                       ("strategies", strategies)):
        if rows:
            write_csv(os.path.join(a.out, name + ".csv"), rows)
        elif os.path.exists(os.path.join(a.out, name + ".csv")):
            os.remove(os.path.join(a.out, name + ".csv"))  # not stale figures of another grid

    j = s.first
    backend = j.get("backend", "unknown backend")
    ncores = cores()
    isa = j.get("host_isa") or j.get("isa") or bench_isa or "unknown"
    if a.machine:
        machine = a.machine
    elif backend in DEVICE_BACKENDS:
        machine = (gpu_names() or backend + " GPU") + f", host {cpu_model()}"
    else:
        machine = f"{cpu_model()}, {ncores} cores"
    meta = dict(date=date, machine=machine, cores=ncores, backend=backend, kokkos_version=j.get("kokkos_version", ""),
                kfa_version=j.get("kfa_version", ""), host_isa=isa, dtype=a.dtype, batch=a.batch, heads=a.heads,
                head_dim=a.head_dim, reps=a.reps, ranks=ranks, strong_seq=n_strong, per_rank=per_rank,
                lengths=lengths, doc_lognormal=a.doc_lognormal, mpiexec=s.mpiexec, command=[os.path.basename(sys.argv[0])] + sys.argv[1:],
                omp_num_threads=os.environ.get("OMP_NUM_THREADS", "cores / ranks"), source=source,
                other_cores_busy_mean=round(sum(x["other_cores_busy"] for v in runs.values() for x in v) /
                                            sum(len(v) for v in runs.values()), 2),
                load_average_before=[round(x, 2) for x in load_before],
                load_average_after=[round(x, 2) for x in os.getloadavg()], wall_s=round(time.time() - s.t0))
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    for old in ("strong.png", "weak.png", "causal.png", "memory.png", "speed.png"):
        if os.path.exists(os.path.join(a.out, old)):
            os.remove(os.path.join(a.out, old))  # a plot is either from this run or absent
    if plt is not None:
        plots(plt, a, meta, strong, weak, causal, memory, speed)
    print("wrote", ", ".join(sorted(os.listdir(a.out))))
    return 0


def plots(plt, a, meta, strong, weak, causal, memory, speed):
    from matplotlib.ticker import NullLocator

    ranks, ncores = meta["ranks"], meta["cores"]
    host = meta["backend"] not in DEVICE_BACKENDS
    over = host and ranks[-1] > ncores
    shape = f"{a.heads} heads, head dim {a.head_dim}, batch {a.batch}" + \
        (f", documents log-normal (median, sigma, min, max, seed) = ({a.doc_lognormal})" if a.doc_lognormal else "")
    where = (f"{meta['machine']}; Kokkos {meta['kokkos_version']} {meta['backend']}, host SIMD {meta['host_isa']}; "
             f"{meta['date']}; median of {a.reps} run{'s' if a.reps > 1 else ''}" +
             (", bars min-max" if a.reps > 1 else "") +
             f"; other processes kept {meta['other_cores_busy_mean']:.1f} cores busy on average during the runs")

    def figure(title, caption):
        fig, ax = plt.subplots(figsize=(7, 5.2))
        fig.subplots_adjust(bottom=0.25, top=0.9)
        ax.set_title(title, fontsize=11)
        fig.text(0.5, 0.015, caption + "\n" + where, ha="center", va="bottom", fontsize=7.5, wrap=True)
        return fig, ax

    def rank_axis(ax):
        ax.set_xlim(0, ranks[-1] + 0.5)
        ax.set_xticks([0] + ranks)  # integers only: the rank counts run
        ax.set_xlabel("MPI ranks" + (f" (shaded: more ranks than the {ncores} cores, oversubscribed)" if over else ""))
        if over:
            ax.axvspan(ncores + 0.5, ranks[-1] + 0.5, color="0.9", zorder=0)

    def seq_axis(ax, seqs):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs)
        ax.set_xticklabels([str(n) for n in seqs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("sequence length N")

    def bars(rows, key):
        return [[r[key] - r[key + "_min"] for r in rows], [r[key + "_max"] - r[key] for r in rows]]

    def save(fig, name):
        fig.savefig(os.path.join(a.out, name), dpi=100)
        plt.close(fig)

    d = meta["dtype"]
    fig, ax = figure(f"strong scaling: N = {strong[0]['seq']}, {d}, no mask",
                     f"kfa-longseq forward, {shape}, contiguous layout; speed-up = compute time on 1 rank / on P ranks")
    ax.errorbar([r["ranks"] for r in strong], [r["speedup"] for r in strong], yerr=bars(strong, "speedup"), fmt="o-",
                capsize=4, label="kfa-longseq")
    ax.plot([0] + ranks, [0] + ranks, "k--", lw=1, label="ideal")
    rank_axis(ax)
    ax.set_ylim(0, max(ranks[-1], max(r["speedup_max"] for r in strong)) * 1.08)
    ax.set_ylabel("speed-up")
    ax.legend(loc="upper left")
    save(fig, "strong.png")

    fig, ax = figure(f"weak scaling: {weak[0]['seq']} tokens per rank, {d}, no mask",
                     f"kfa-longseq forward, {shape}, contiguous layout; efficiency = TFLOP/s per rank / TFLOP/s on 1 rank"
                     + "; N = tokens per rank x P, so each rank's work grows with P (its query shard meets all N keys)")
    ax.errorbar([r["ranks"] for r in weak], [r["efficiency"] for r in weak], yerr=bars(weak, "efficiency"), fmt="o-",
                capsize=4, label="kfa-longseq")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="ideal")
    rank_axis(ax)
    ax.set_ylim(0, max(1.1, max(r["efficiency_max"] for r in weak) * 1.08))
    ax.set_ylabel("efficiency")
    ax.legend(loc="lower left")
    save(fig, "weak.png")

    if causal:
        fig, ax = figure(f"causal, N = {causal[0]['seq']}, {d}: contiguous vs zigzag sharding",
                         f"kfa-longseq forward, {shape}, causal mask (bottom-right); compute time of the slowest rank")
        ps = sorted({r["ranks"] for r in causal})
        for i, lay in enumerate(("contiguous", "zigzag")):
            rs = [r for r in causal if r["layout"] == lay]
            ax.bar([r["ranks"] + (i - 0.5) * 0.35 for r in rs], [r["compute_s"] for r in rs], width=0.35,
                   yerr=bars(rs, "compute_s"), capsize=4, label=lay)
        ax.set_xticks(ps)
        ax.set_xlim(min(ps) - 0.8, max(ps) + 0.8)
        crowded = [str(p) for p in ps if p > ncores] if host else []
        ax.set_xlabel("MPI ranks" + (f" ({', '.join(crowded)} ranks: more than the {ncores} cores, oversubscribed)"
                                     if crowded else ""))
        ax.set_ylim(0, max(r["compute_s_max"] for r in causal) * 1.15)
        ax.set_ylabel("compute time [s]")
        ax.legend(loc="upper right")
        save(fig, "causal.png")

    fig, ax = figure(f"memory vs sequence length, 1 rank, {d}, no mask",
                     f"{shape}; high-water: kfa-longseq's whole process (ru_maxrss, inputs included); extra: "
                     "allocations during one forward call, kfa_bench_forward (float)")
    ax.plot([r["seq"] for r in memory], [r["kfa_rank_high_water_mib"] for r in memory], "o-",
            label="kfa-longseq, whole-process high-water")
    rm = [r for r in memory if r["reference_extra_mib"] != ""]
    if rm:
        ax.plot([r["seq"] for r in rm], [r["reference_extra_mib"] for r in rm], "s-",
                label="materialized reference, extra allocations")
        km = [r for r in rm if r["kfa_extra_mib"] > 0]
        if km:
            ax.plot([r["seq"] for r in km], [r["kfa_extra_mib"] for r in km], "^-", label="kfa forward, extra allocations")
        if len(km) < len(rm):
            ax.text(0.98, 0.02, f"kfa forward's extra allocations: 0.0 MiB at N = {', '.join(str(r['seq']) for r in rm if r not in km)}"
                    " (not drawn on a log axis)", transform=ax.transAxes, ha="right", fontsize=8)
    ax.set_yscale("log")
    seq_axis(ax, [r["seq"] for r in memory])
    ax.set_ylabel("MiB")
    ax.legend(loc="upper left")
    save(fig, "memory.png")

    fig, ax = figure(f"kfa-longseq forward, 1 rank: {d}, no mask",
                     f"{shape}; TFLOP/s = 4 x batch x heads x N^2 x head dim / compute time")
    ax.errorbar([r["seq"] for r in speed], [r["tflops"] for r in speed], yerr=bars(speed, "tflops"), fmt="o-", capsize=4)
    seq_axis(ax, [r["seq"] for r in speed])
    ax.set_ylim(0, max(r["tflops_max"] for r in speed) * 1.15)
    ax.set_ylabel("TFLOP/s")
    save(fig, "speed.png")


if __name__ == "__main__":
    sys.exit(main())
