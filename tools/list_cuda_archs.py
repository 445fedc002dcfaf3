#!/usr/bin/env python3
import struct, sys
# Lists the CUDA code in an executable's fat binaries: "sm_90 elf", "compute_120 ptx", ...
def archs(path):
    data = open(path, "rb").read()
    found = set()
    at = data.find(b"\x50\xed\x55\xba")
    while at >= 0:
        magic, version, hsize, fsize = struct.unpack_from("<IHHQ", data, at)
        pos, end = at + hsize, at + hsize + fsize
        while pos + 64 <= min(end, len(data)):
            kind, _, ehsize, size = struct.unpack_from("<HHIQ", data, pos)
            arch = struct.unpack_from("<I", data, pos + 28)[0]
            if kind == 2: found.add(f"sm_{arch} elf")
            elif kind == 1: found.add(f"compute_{arch} ptx")
            if ehsize == 0: break
            pos += ehsize + size
        at = data.find(b"\x50\xed\x55\xba", at + 4)
    return sorted(found)
for p in sys.argv[1:]:
    print(p, ", ".join(archs(p)))
