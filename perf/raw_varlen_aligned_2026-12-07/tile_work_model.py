import math
L=[2451,387,1770,4388,205,432,610,2463,684,1933,233,2420,242,329,3323,4081,700,1024,2593,359,2533,882,304,2606,1605,600,1246,333,183,3017,1113,595,456,709,1331,1117,1278,260,6985,2126,647,1304,715,852,1121,903,88]
cu=[0]
for l in L: cu.append(cu[-1]+l)
T=cu[-1]
def docs_of(i0,i1):
    return [d for d in range(len(L)) if cu[d]<i1 and cu[d+1]>i0]
def work_block(i0,i1,BQ,BC,causal):
    w=0
    for d in docs_of(i0,i1):
        jb=cu[d]; je=cu[d+1]
        if causal: je=min(je, min(i1,cu[d+1]))  # keys <= last row
        if je>jb: w+=BQ*BC*math.ceil((je-jb)/BC)
    return w
def useful(causal):
    return sum(l*l*(0.5 if causal else 1) for l in L)
for BQ,BC in [(128,128),(192,128),(128,176)]:
  for causal in (0,1):
    cur=sum(work_block(i0,min(i0+BQ,T),BQ,BC,causal) for i0 in range(0,T,BQ))
    al=0
    for d in range(len(L)):
        for i0 in range(cu[d],cu[d+1],BQ):
            al+=work_block(i0,min(i0+BQ,cu[d+1]),BQ,BC,causal)
    n=2688; nb=math.ceil(n/BQ); fx=0
    for qb in range(nb):
        i1=min((qb+1)*BQ,n); je=i1 if causal else n
        fx+=BQ*BC*math.ceil(je/BC)
    fxe=(n*n*(0.5 if causal else 1))/fx
    print(BQ,BC,causal,"eff cur %.3f aligned %.3f fixed %.3f  -> ratio cur %.3f aligned %.3f"%(useful(causal)/cur,useful(causal)/al,fxe,useful(causal)/cur/fxe,useful(causal)/al/fxe))
