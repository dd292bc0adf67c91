import heapq, math
L=[2451,387,1770,4388,205,432,610,2463,684,1933,233,2420,242,329,3323,4081,700,1024,2593,359,2533,882,304,2606,1605,600,1246,333,183,3017,1113,595,456,709,1331,1117,1278,260,6985,2126,647,1304,715,852,1121,903,88]
B=128; SM=132; H=16; OV=1.0  # per-block overhead in tile units
def blocks_doc(L,causal):
    # list of work per virtual index v (aligned grid), per pair
    cu=[0]
    for l in L: cu.append(cu[-1]+l)
    T=cu[-1]; nb=T//B+len(L); w=[0.0]*nb
    for s,l in enumerate(L):
        f=cu[s]//B+s
        for k in range(math.ceil(l/B)):
            r1=min(l,(k+1)*B)
            keys=r1 if causal else l
            w[f+k]=math.ceil(keys/B)+OV
    return w
def sim(seq):
    h=[0.0]*SM; heapq.heapify(h)
    for w in seq:
        if w==0: continue
        t=heapq.heappop(h); heapq.heappush(h,t+w)
    return max(h), sum(seq)
def order(w,pairs,section):
    nb=len(w); out=[]
    for first in range(0,pairs,section):
        here=min(section,pairs-first)
        for rank in range(nb):
            for p in range(here): out.append(w[nb-1-rank])
    return out
for causal in (0,1):
    w=blocks_doc(L,causal)
    for sec in (1,4,16):
        ms,tot=sim(order(w,H,sec)); print('causal',causal,'section',sec,'eff %.3f'%(tot/SM/ms))
    # fixed 24x2688
    n=2688; nb=n//B; wf=[(math.ceil(min(n,(i+1)*B)/B) if causal else nb)+OV for i in range(nb)]
    sec=max(1,min(24*H,(SM+nb//2)//nb)) if causal else 1
    ms,tot=sim(order(wf,24*H,sec)); print('  fixed eff %.3f'%(tot/SM/ms))
print('equal 16x4096')
for causal in (1,):
    w=blocks_doc([4096]*16,causal)
    for sec in (1,2,4,16):
        ms,tot=sim(order(w,H,sec)); print('causal',causal,'section',sec,'eff %.3f'%(tot/SM/ms))
    n=4096; nb=n//B; wf=[(math.ceil(min(n,(i+1)*B)/B) if causal else nb)+OV for i in range(nb)]
    sec=max(1,min(16*H,(SM+nb//2)//nb))
    ms,tot=sim(order(wf,16*H,sec)); print('  fixed sec',sec,'eff %.3f'%(tot/SM/ms))
for causal in (0,1):
    w=blocks_doc(L,causal); per=max(1,len(w)//len(L)); sec=max(1,min(H,(SM+per//2)//per))
    ms,tot=sim(order(w,H,sec)); print('mix causal',causal,'rule section',sec,'eff %.3f'%(tot/SM/ms))
