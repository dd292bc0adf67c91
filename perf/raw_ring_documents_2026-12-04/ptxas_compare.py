import re,sys
def parse(path):
    d={}; cur=None; arch=None; props=None
    for l in open(path):
        m=re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'",l)
        if m: cur=(m.group(2),m.group(1)); continue
        m=re.search(r"Function properties for (\S+)",l)
        if m: props=m.group(1); continue
        m=re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",l)
        if m and cur and props==cur[1]:
            d.setdefault(cur,{})['spill']=int(m.group(2))+int(m.group(3)); continue
        m=re.search(r"Used (\d+) registers",l)
        if m and cur: d.setdefault(cur,{})['regs']=int(m.group(1))
    return d
a=parse(sys.argv[1]); b=parse(sys.argv[2])
n=0
for k in sorted(a):
    if a[k]!=b.get(k):
        n+=1; print(k[0], a[k], '->', b.get(k), k[1][:70])
print("entries",len(a),len(b),"differ",n)
print("spilling in", sys.argv[2], [ (k[0],k[1][:60],v) for k,v in b.items() if v.get('spill',0)>0])
