import sys,re,hashlib
cur=None; out={}
for l in sys.stdin:
    m=re.match(r"^[0-9a-f]+ <(.*)>:$",l)
    if m: cur=m.group(1); out[cur]=[]; continue
    if cur and "\t" in l:
        ins=l.split("\t",1)[1].strip()
        ins=re.sub(r"<[^>]*>","<>",ins)
        ins=re.sub(r"0x[0-9a-f]+\(%rip\)","RIP",ins)
        ins=re.sub(r"\b[0-9a-f]{4,}\b","ADDR",ins)
        ins=re.sub(r"#.*","",ins)
        out[cur].append(ins)
mode=sys.argv[1] if len(sys.argv)>1 else 'hash'
if mode=='hash':
    for k,v in out.items():
        if "kfa::" in k: print(hashlib.md5("\n".join(v).encode()).hexdigest(), len(v), k[:200])
else:
    for k,v in out.items():
        if k.startswith(mode): print("\n".join(v)); break
