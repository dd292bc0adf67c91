import time, statistics, torch, torch.nn.functional as F, os
torch.set_num_threads(1); os.sched_setaffinity(0, {1})
def med(fn, reps=3):
    fn(); ts=[]
    for _ in range(reps):
        t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0)
    return statistics.median(ts)
for rnd in range(2):
  for d in (64, 128):
    for n in (4096, 8192):
        h=2
        fl=4*h*n*n*d
        with torch.no_grad():
            qc,kc,vc=(torch.rand(1,h,n,d)*2-1 for _ in range(3))
            qs,ks,vs=(torch.rand(1,n,h,d).mul(2).sub(1).transpose(1,2) for _ in range(3))
            tc=med(lambda: F.scaled_dot_product_attention(qc,kc,vc))
            ts=med(lambda: F.scaled_dot_product_attention(qs,ks,vs))
        print(f"d {d} N {n} torch contiguous [B,H,N,d] {fl/tc*1e-9:.1f}  torch on [B,N,H,d] memory {fl/ts*1e-9:.1f} GFLOP/s", flush=True)
