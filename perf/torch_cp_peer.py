#!/usr/bin/env python3
"""PyTorch's context parallelism (ring SDPA over NCCL) as a yardstick for kfa's ring attention benchmark.

Times torch.distributed.tensor.experimental.context_parallel (F.scaled_dot_product_attention dispatched to
torch's ring attention over the device mesh) on the shapes of perf/bench_ring.cpp (kfa_bench_ring):
layout [B, H, N, d] as SDPA wants, global sequence N = tokens_per_rank * P, each rank holding N / P
tokens. At P = 1 it times plain F.scaled_dot_product_attention on the full sequence (no mesh, no CP), so
weak scaling P = 1 -> 2 can be read off. PyTorch is a yardstick only, never a dependency of kfa.

Timing: per rep, dist.barrier, torch.cuda.synchronize, time.perf_counter around the forward (and
backward with --backward), torch.cuda.synchronize; each rep's time is the slowest rank's (all_reduce
MAX); median, min and max over --reps after --warmup untimed reps. FLOPs as kfa_bench_ring counts them:
forward 4 * B * H * N^2 * d over the whole sequence, halved with --causal; forward+backward 3.5 times
that. TFLOP/s = FLOPs / median time; per GPU = that / P.

--check first runs the same path on a small global sequence (--check-tokens, default 4096) and compares
every rank's shard of the CP output (and dQ, dK, dV with --backward), taken in the order in which CP
sharded the sequence (head-tail load balancing reorders it for causal), with float32 math SDPA on the
full sequence; plain same-dtype SDPA on one device is compared with the same reference, for scale.
Exit status 3 when the CP error exceeds max(4 x plain error, a per-dtype floor).

Commands (2 x H200; the NCCL/NVSHMEM variables below are set here with setdefault anyway):

  # weak scaling P = 1 -> 2, bf16, causal, forward and forward+backward (--both), with a check
  python3 perf/torch_cp_peer.py --tokens-per-rank 131072 --causal --both --check --json $OUT/torch_p1.json
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --standalone --nproc-per-node=2 perf/torch_cp_peer.py --tokens-per-rank 131072 --causal --both \\
    --check --json $OUT/torch_p2.json
  # the same under Open MPI (ranks, sizes and local ranks from OMPI_COMM_WORLD_*; MASTER_ADDR 127.0.0.1)
  mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE=0 -x TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    -x NVSHMEM_DISABLE_NVLS=1 python3 perf/torch_cp_peer.py --tokens-per-rank 131072 --causal --backward
  # options: --dtype bfloat16|float16|float32  --backend flash|cudnn|efficient  --heads 8 --head-dim 128
  #          --batch 1 --reps 3 --warmup 1 --rotate allgather|alltoall --no-load-balance
  #          (--backend efficient for float32: flash and cuDNN have no float32)

  # on a machine without a GPU (gloo; small sizes; exercises parsing, sharding, the check and the output)
  python3 perf/torch_cp_peer.py --device cpu --tokens-per-rank 512 --heads 2 --head-dim 64 --causal --both --check
  torchrun --standalone --nproc-per-node=2 perf/torch_cp_peer.py --device cpu --tokens-per-rank 256 \\
    --heads 2 --head-dim 32 --causal --both --check

Output, rank 0, one line per configuration, e.g.

  torch_cp_peer P=2 N=262144 tokens/rank=131072 batch=1 heads=8 d=128 dtype=bfloat16 causal=1 backend=flash
  rotate=allgather lb=1 fwd: median 0.1234 s (min 0.1200 max 0.1300, reps 3), 123.4 TFLOP/s, 61.7 TFLOP/s
  per GPU, torch 2.11.0

(one line; "fwd+bwd:" for --backward), after a "torch_cp_peer env:" header line. --json FILE writes the
header facts and one record per line printed. torch is imported after argument parsing, so --help works
without it.

torch 2.11 facts this relies on (torch/distributed/tensor/experimental/_context_parallel/_attention.py):
context_parallel(mesh, buffers=, buffer_seq_dims=, no_restore_buffers=) shards the buffers in place
along their sequence dims and monkey-patches F.scaled_dot_product_attention, whose flash, efficient and
cuDNN aten ops (and their backwards) are then dispatched, through DTensor, to the ring implementations;
the math backend and the CPU flash kernel are not (for --device cpu with P > 1 this script adds a handler
for the CPU flash ops built from torch's own ring templates, see register_cpu_ring_ops). _cp_options.
enable_load_balance (default True) makes context_parallel reorder the sequence head-tail before sharding
(rank r holds chunks r and 2P-1-r of 2P) and must be False without causal (torch raises otherwise);
without it, causal CP skips the blocks above the diagonal and the ranks are unbalanced.
_cp_options.rotate_method (set_rotate_method) is "allgather" by default (one all-gather of K and V,
then local steps) or "alltoall" (a true ring of permute_tensor sends).
"""
import argparse
import json
import os
import statistics
import sys
import time

REQUIRED_ENV = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
)

# The floor of the --check tolerance on the max abs error against float32 math SDPA, per dtype.
CHECK_FLOOR = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="torch_cp_peer.py",
        description="Time PyTorch context parallelism (ring SDPA) on kfa_bench_ring's shapes; "
        "P = 1 times plain SDPA on the full sequence.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--tokens-per-rank", type=int, default=131072, help="tokens per rank; global N = this * P")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--backend", choices=["flash", "cudnn", "efficient"], default="flash",
                   help="SDPA backend forced with sdpa_kernel")
    p.add_argument("--causal", action="store_true")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--backward", action="store_true", help="time forward+backward instead of forward")
    mode.add_argument("--both", action="store_true", help="time forward, then forward+backward (two lines)")
    p.add_argument("--reps", type=int, default=3, help="timed reps (median, min, max reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed reps first")
    p.add_argument("--rotate", choices=["allgather", "alltoall"], default="allgather",
                   help="CP's K/V rotation (torch's set_rotate_method; its default is allgather)")
    p.add_argument("--no-load-balance", action="store_true",
                   help="causal without CP's head-tail load balancing (contiguous shards)")
    p.add_argument("--check", action="store_true",
                   help="first compare the CP result with full-sequence SDPA on a small size")
    p.add_argument("--check-tokens", type=int, default=4096, help="global sequence length of --check")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo, for testing the script without a GPU")
    p.add_argument("--json", metavar="FILE", help="write the header facts and the records as JSON (rank 0)")
    a = p.parse_args(argv)
    for name in ("tokens_per_rank", "heads", "head_dim", "batch", "reps", "check_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.device == "cuda" and a.dtype == "float32" and a.backend != "efficient":
        p.error(f"the CUDA {a.backend} SDPA backend has no float32: use --backend efficient")
    if a.causal and not a.no_load_balance and (a.tokens_per_rank % 2 or a.check_tokens % 2):
        p.error("causal load balancing splits each rank's tokens in two: use even token counts")
    return a


def attention_flops(batch, heads, n_total, head_dim, causal, backward):
    """kfa_bench_ring's count: 4·B·H·N²·d for the forward, halved when causal, ×3.5 for forward+backward."""
    f = 4.0 * batch * heads * float(n_total) * float(n_total) * head_dim
    if causal:
        f *= 0.5
    if backward:
        f *= 3.5
    return f


def launcher_env():
    """(rank, world size, local rank, launcher) from torchrun's variables, or Open MPI's / PMI's (then
    exported as torchrun's, with MASTER_ADDR 127.0.0.1 and a MASTER_PORT unless set), or one process."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", e["RANK"])), "torchrun"
    for r, s, lr, name in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun"),
                           ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "mpirun(pmi)")):
        if r in e and s in e:
            rank, world = int(e[r]), int(e[s])
            local = int(e.get(lr, rank))
            e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"] = str(rank), str(world), str(local)
            e.setdefault("LOCAL_WORLD_SIZE", e.get("OMPI_COMM_WORLD_LOCAL_SIZE", str(world)))
            e.setdefault("MASTER_ADDR", "127.0.0.1")
            e.setdefault("MASTER_PORT", "29517")
            return rank, world, local, name
    return 0, 1, 0, "single"


def fmt_rate(x):
    return f"{x:.1f}" if x >= 10 else f"{x:.4g}"


def fmt_s(x):
    return f"{x:.4f}" if x >= 0.01 else f"{x:.3e}"


def record_line(r):
    mode = "fwd+bwd" if r["backward"] else "fwd"
    return (f"torch_cp_peer P={r['P']} N={r['N']} tokens/rank={r['tokens_per_rank']} batch={r['batch']} "
            f"heads={r['heads']} d={r['head_dim']} dtype={r['dtype']} causal={int(r['causal'])} "
            f"backend={r['backend']} rotate={r['rotate']} lb={int(r['load_balance'])} {mode}: "
            f"median {fmt_s(r['median_s'])} s (min {fmt_s(r['min_s'])} max {fmt_s(r['max_s'])}, reps {r['reps']}), "
            f"{fmt_rate(r['tflops'])} TFLOP/s, {fmt_rate(r['tflops_per_gpu'])} TFLOP/s per GPU, torch {r['torch']}")


def summarize(times, flops, world):
    med = statistics.median(times)
    tf = flops / med * 1e-12
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "times_s": list(times),
            "flops": flops, "tflops": tf, "tflops_per_gpu": tf / world}


def register_cpu_ring_ops(mesh):
    """For --device cpu with P > 1 only: route the CPU flash SDPA ops to torch's ring templates.

    torch's CP maps the CUDA flash / efficient / cuDNN SDPA aten ops (and their backwards) to its ring
    implementations through DTensor custom op handlers (_context_parallel/_attention.py, custom_ops); the CPU
    flash op has no such entry ("does not have a sharding strategy registered"). This adds one, built the
    way torch builds the CUDA ones (_templated_ring_attention[_backward] with the op as the block kernel),
    so that the CPU run goes through the very context_parallel path that the GPU run times: in-place
    sharding of the buffers, head-tail load balancing, the ring merge, DTensor autograd, the collectives.
    """
    import torch
    from torch.distributed.tensor import DTensor, Shard
    import torch.distributed.tensor.experimental._context_parallel._attention as cpa

    aten = torch.ops.aten
    group = mesh.get_group()

    def wrap(ts):
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in ts)

    def local(x):
        return x._local_tensor if isinstance(x, DTensor) else x

    def options(args, kwargs, n):
        # aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
        # and ..._backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
        dropout = args[n] if len(args) > n else kwargs.get("dropout_p", 0.0)
        causal = args[n + 1] if len(args) > n + 1 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None or dropout:
            raise NotImplementedError("CPU ring: no attn_mask, no dropout")
        return bool(causal), kwargs.get("scale")

    def forward(op_call, args, kwargs):
        causal, scale = options(args, kwargs, 3)
        q, k, v = (local(a) for a in args[:3])
        out, lse, *_ = cpa._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
            is_causal=causal, scale=scale)
        return wrap((out, lse))

    def backward(op_call, args, kwargs):
        causal, scale = options(args, kwargs, 6)
        g, q, k, v, out, lse = (local(a) for a in args[:6])
        grads = cpa._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=g,
            grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=causal,
            dropout_p=0.0, scale=scale)
        return wrap(grads[:3])

    cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = backward


def main(argv=None):
    for k, v in REQUIRED_ENV:
        os.environ.setdefault(k, v)
    args = parse_args(argv)
    rank, world, local_rank, launcher = launcher_env()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    on_gpu = args.device == "cuda"
    if on_gpu:
        if not torch.cuda.is_available():
            sys.exit("torch_cp_peer: no CUDA device (use --device cpu to test without a GPU)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[args.backend]
    load_balance = bool(args.causal and not args.no_load_balance and world > 1)

    distributed = launcher != "single"
    if distributed:
        kw = {"backend": "nccl" if on_gpu else "gloo", "init_method": "env://"}
        if on_gpu:
            kw["device_id"] = device
        dist.init_process_group(**kw)
        assert dist.get_rank() == rank and dist.get_world_size() == world

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def barrier():
        if distributed:
            dist.barrier()

    def max_over_ranks(values):
        t = torch.tensor(values, dtype=torch.float64, device=device)
        if distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    mesh = None
    cp = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        # Must be False without causal (the ring raises otherwise); with causal it selects head-tail sharding.
        _cp_options.enable_load_balance = load_balance
        set_rotate_method(args.rotate)
        cp = context_parallel

    header = {
        "launcher": launcher, "P": world, "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__.split("+")[0], "torch_full": torch.__version__,
        "cuda": torch.version.cuda, "nccl": (".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None),
        "cudnn": (torch.backends.cudnn.version() if on_gpu else None),
        "env": {k: os.environ.get(k) for k, _ in REQUIRED_ENV},
    }
    if rank == 0:
        envs = " ".join(f"{k}={v}" for k, v in header["env"].items())
        print(f"torch_cp_peer env: {envs} launcher={launcher} P={world} device={header['device_name']} "
              f"torch={header['torch_full']} cuda={header['cuda']} nccl={header['nccl']} cudnn={header['cudnn']}",
              flush=True)

    def make_inputs(n_total, seed):
        """Full-sequence q, k, v, dO, identical on every rank (same seed, same generator)."""
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        shape = (args.batch, args.heads, n_total, args.head_dim)
        return [torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype) for _ in range(4)]

    def sdpa(q, k, v):
        # Looked up at call time: inside context_parallel, F.scaled_dot_product_attention is CP's.
        return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

    if world > 1 and not on_gpu:
        register_cpu_ring_ops(mesh)

    def order_indices(n_total):
        """The sequence order in which CP shards (rank r gets the r-th of P equal slices), or None."""
        if not load_balance:
            return None
        try:
            from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
                _create_default_load_balancer)
            lb = _create_default_load_balancer(n_total, world, device)
            if lb is not None:
                return lb._generate_indices()[0].to(device)
        except ImportError:
            pass
        c = n_total // (2 * world)  # head-tail: rank r holds chunks r and 2P-1-r
        idx = []
        for r in range(world):
            idx += list(range(r * c, (r + 1) * c)) + list(range(n_total - (r + 1) * c, n_total - r * c))
        return torch.tensor(idx, device=device)

    def local_slice(full, idx):
        if idx is not None:
            full = full.index_select(2, idx)
        return full.chunk(world, dim=2)[rank]

    def shard_and_run(n_total, seed, body):
        """Make full q, k, v, dO, shard them as CP does (P > 1) and call body(q, k, v, do, run_sdpa)."""
        q, k, v, do = make_inputs(n_total, seed)
        if world == 1:
            return body(q, k, v, do, sdpa)
        bufs = [q, k, v, do]
        with cp(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            return body(q, k, v, do, sdpa)

    def check(backward):
        n_total = args.check_tokens
        if n_total % (2 * world):
            sys.exit(f"torch_cp_peer: --check-tokens {n_total} must be a multiple of 2P = {2 * world}")
        full = make_inputs(n_total, args.seed + 1)
        # Reference: float32 math SDPA on the full sequence; and plain same-dtype SDPA, same backend.
        with sdpa_kernel([SDPBackend.MATH]):
            ref = [t.detach().float().clone().requires_grad_(backward) for t in full[:3]]
            ref_o = F.scaled_dot_product_attention(*ref, is_causal=args.causal)
            if backward:
                ref_o.backward(full[3].float())
        with sdpa_kernel([backend]):
            pl = [t.detach().clone().requires_grad_(backward) for t in full[:3]]
            pl_o = sdpa(*pl)
            if backward:
                pl_o.backward(full[3])
        names = ["out"] + (["dq", "dk", "dv"] if backward else [])
        ref_t = [ref_o] + ([t.grad for t in ref] if backward else [])
        pl_t = [pl_o] + ([t.grad for t in pl] if backward else [])
        plain_err = [(a.float() - b).abs().max().item() for a, b in zip(pl_t, ref_t)]

        def body(q, k, v, do, run):
            with sdpa_kernel([backend]):
                for t in (q, k, v):
                    t.requires_grad_(backward)
                o = run(q, k, v)
                if backward:
                    o.backward(do)
            return [o.detach()] + ([q.grad, k.grad, v.grad] if backward else [])

        got = shard_and_run(n_total, args.seed + 1, body)
        idx = order_indices(n_total)
        cp_err = max_over_ranks([(g.float() - local_slice(r.detach(), idx)).abs().max().item()
                                 for g, r in zip(got, ref_t)])
        floor = CHECK_FLOOR[args.dtype]
        ok = all(c <= max(4 * p, floor) for c, p in zip(cp_err, plain_err))
        if rank == 0:
            what = "CP" if world > 1 else "SDPA"
            errs = ", ".join(f"{n} {c:.3e} (plain {p:.3e})" for n, c, p in zip(names, cp_err, plain_err))
            print(f"torch_cp_peer check P={world} N={n_total} dtype={args.dtype} causal={int(args.causal)} "
                  f"backend={args.backend} lb={int(load_balance)} {'fwd+bwd' if backward else 'fwd'}: {what} vs "
                  f"float32 math SDPA on the full sequence, max abs error {errs}: {'PASS' if ok else 'FAIL'}",
                  flush=True)
        return {"N": n_total, "backward": backward, "names": names, "max_abs_err": cp_err,
                "plain_max_abs_err": plain_err, "pass": ok}

    def timed(backward):
        n_total = args.tokens_per_rank * world

        def body(q, k, v, do, run):
            times = []
            with sdpa_kernel([backend]):
                for t in (q, k, v):
                    t.requires_grad_(backward)
                for i in range(args.warmup + args.reps):
                    for t in (q, k, v):
                        t.grad = None
                    barrier()
                    sync()
                    t0 = time.perf_counter()
                    o = run(q, k, v)
                    if backward:
                        o.backward(do)
                    sync()
                    t1 = time.perf_counter()
                    del o
                    if i >= args.warmup:
                        times.append(t1 - t0)
            return times

        times = max_over_ranks(shard_and_run(n_total, args.seed, body))
        r = {"P": world, "N": n_total, "tokens_per_rank": args.tokens_per_rank, "batch": args.batch,
             "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype, "causal": args.causal,
             "backend": args.backend, "rotate": args.rotate if world > 1 else "none",
             "load_balance": load_balance, "backward": backward, "reps": args.reps, "warmup": args.warmup,
             "torch": header["torch"], "impl": "context_parallel" if world > 1 else "sdpa"}
        r.update(summarize(times, attention_flops(args.batch, args.heads, n_total, args.head_dim,
                                                  args.causal, backward), world))
        if rank == 0:
            print(record_line(r), flush=True)
        return r

    modes = [False, True] if args.both else [args.backward]
    checks, records = [], []
    if args.check:
        checks = [check(m) for m in modes]
    for m in modes:
        records.append(timed(m))

    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "args": vars(args), "checks": checks, "records": records,
                       "lines": [record_line(r) for r in records]}, f, indent=1)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0 if all(c["pass"] for c in checks) else 3


if __name__ == "__main__":
    sys.exit(main())
