#!/usr/bin/env python3
"""Registers, stack frame and spills of kfa's kernels from an `nvcc -Xptxas -v` log (kernel names
demangled with c++filt and shortened to the kfa functor and its element type).

  python3 perf/ptxas_report.py build.log
"""
import re
import subprocess
import sys

cur = None
seen = set()
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
        name = subprocess.run(["c++filt", m.group(1)], capture_output=True, text=True).stdout
        k = re.search(r"kfa::detail::(\w+Kernel|tc_\w+_kernel)<([^,>]+(?:, (?:true|false))*)", name)
        t = re.search(r"(?:View<|kernel<\d+, (?:true|false), )(?:Kokkos::Experimental::Impl::floating_point_wrapper<(\w+)>|(\w+))", name)
        ty = {"__half": "half", "__nv_bfloat16": "bfloat16"}.get(t.group(1), t.group(1)) if t and t.group(1) else (t.group(2) if t else "?")
        flags = k.group(2) if k else ""
        if ty.isdigit():  # an int parameter after the flags (the 3xTF32 dQ kernel's warps), not a type
            flags, ty = f"{flags}, {ty}", "?"
        if ty == "?" and "tf32" in name:
            ty = "float"  # the 3xTF32 kernels have no element-type parameter
        cur = f"{k.group(1)}<{flags}> {ty}" if k else None
        stack = None
    elif cur and "stack frame" in line:
        stack = line.strip()
    elif cur and "registers" in line:
        regs = re.search(r"Used (\d+) registers", line).group(1)
        key = (cur, regs, stack)
        if key not in seen:
            seen.add(key)
            print(f"{cur:70s} {regs:>4s} regs  {stack}")
