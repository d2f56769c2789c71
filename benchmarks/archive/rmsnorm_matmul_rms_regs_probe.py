"""Probe: rmsnorm_matmul_rms_probe.py with A fed to wgmma from the registers its row
squares are summed from (matmul-row-rms-regs.patch, on top of matmul-row-rms.patch: A
leaves shared memory once instead of twice), against the shipped form, one H200, M x 4096
@ 4096 x N bf16, at three shapes, two timed rounds in opposite orders.

    git apply benchmarks/archive/matmul-row-rms.patch
    git apply benchmarks/archive/matmul-row-rms-regs.patch
    PYTHONUNBUFFERED=1 python3 benchmarks/archive/rmsnorm_matmul_rms_regs_probe.py
"""

SHAPES = """for m, n in (
    (16384, 1024),
    (16384, 4096),
    (16384, 12288),
    (8192, 1024),
    (4096, 1024),
    (8192, 4096),
):"""
AUTO = """        "ts auto": jax.jit(lambda x, w, b: rmm.rmsnorm_matmul(x, w, b, eps=EPS)),
"""
src = open("benchmarks/archive/rmsnorm_matmul_rms_probe.py").read()
assert SHAPES in src and AUTO in src
# That probe at three of its shapes, without the auto row.
src = src.replace(SHAPES, "for m, n in ((16384, 1024), (16384, 4096), (8192, 1024)):")
exec(src.replace(AUTO, ""), {"__name__": "__main__"})
