"""Helpers shared by the app tests in this directory (imported by name: Python puts a script's own directory
first on sys.path, so `import apptest` works from any working directory, as CTest runs them).

  mpi_env(extra)      the environment for an mpirun: os.environ, MPI_ENV's defaults, `extra`
  kill_session(sid)   SIGKILL to mpirun and every rank of a Popen(start_new_session=True)
  run_app(...)        the app under mpirun on P ranks: (exit status, output); a hang is killed and returns 124
  check(cond, what)   prints ok/FAIL and records the failure; finish() prints them and gives the exit status
  reference(...)      float64 attention forward and gradients from the definition (numpy)
  generated(...)      the app's generated tensors (the counter hash of apps/README.md), in numpy
"""
import os
import signal
import subprocess
import time

# Open MPI's mpirun, once a rank has exited non-zero, waits odls_base_sigkill_timeout (1 s) between the SIGTERM and
# the SIGKILL it sends the job's processes, even when every rank has already exited: 1 to 2.5 s on top of each
# refused run (~150 of them in these tests, more than half of their time), which no test looks at. 0 ends the job
# as soon as the ranks are gone; a rank still running gets SIGTERM and SIGKILL as before (the app handles neither),
# and mpirun's exit status is the same. Other MPIs ignore OMPI_MCA_* variables; a value in the environment wins.
MPI_ENV = {"OMPI_MCA_odls_base_sigkill_timeout": "0"}


def mpi_env(extra=None):
    """The environment for an mpirun: MPI_ENV's defaults, os.environ over them, then `extra` (this run's variables)."""
    env = dict(MPI_ENV)
    env.update(os.environ)
    env.update(extra or {})
    return env


def kill_session(sid):
    """SIGKILL to every process of session `sid` (a Popen with start_new_session=True): mpirun and the ranks.
    Open MPI puts each rank in a process group of its own, so killpg(mpirun) would leave the ranks running."""
    for _ in range(50):
        left = 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                left += 1
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
        if not left:
            return
        time.sleep(0.05)


def run_app(mpi, app, np_, *args, timeout=300, cwd=None, env=None, launcher=()):
    """Runs `app` with `args` under `mpi` (the launcher and its flags) on np_ ranks; returns (exit status, stdout +
    stderr). A run past `timeout` s is killed (mpirun and every rank) and returns 124, so a hang fails the test
    instead of blocking it. `env`: variables added to the environment (mpi_env); `launcher`: more mpirun options."""
    cmd = mpi[:1] + ["-n", str(np_)] + mpi[1:] + list(launcher) + [app] + [str(a) for a in args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                         start_new_session=True, env=mpi_env(env))
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
        out, _ = p.communicate()
        return 124, (out or "") + f"\n[killed after {timeout} s: hang]"


FAILURES = []


def check(cond, what):
    """Prints the check's outcome; a failure is kept for finish()."""
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)


def finish():
    """Prints the failures (if any) and returns the test's exit status."""
    print(f"{len(FAILURES)} failure(s)")
    if FAILURES:
        print("failed:\n  " + "\n  ".join(FAILURES))
    return 1 if FAILURES else 0


def reference(q, k, v, do, causal, window=(-1, -1), scale=None, softcap=0.0):
    """float64 attention forward and gradients from the definition: (o, lse, dq, dk, dv); q [B,S,H,D], k/v
    [B,S,Hkv,D], do like q; window (left, right), -1 unbounded; scale None: 1/sqrt(D); softcap 0: none."""
    import numpy as np  # here, so that tests without numpy (test_cli.py) can import this module

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


def generated(seed, tensor_id, shape):
    """The app's generated tensor: element `flat` (row-major index in the global [batch, seq, heads, head_dim]
    tensor) of tensor id (0 q, 1 k, 2 v, 3 dO) is splitmix64(seed * golden + id << 56 + flat) mapped to
    [-1, 1) (apps/README.md, "generated inputs")."""
    import numpy as np

    m = np.uint64(0xFFFFFFFFFFFFFFFF)
    flat = np.arange(int(np.prod(shape)), dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + (np.uint64(tensor_id) << np.uint64(56)) + flat
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = (z ^ (z >> np.uint64(31))) & m
    return ((z >> np.uint64(11)).astype(np.float64) * (2.0 / 9007199254740992.0) - 1.0).reshape(shape)
