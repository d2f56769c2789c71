"""Probe: clocks, power and throttle reasons while bf16 8192^3 matmuls run (H100).

For each implementation: a ~3 s loop, NVML sampled every 50 ms from a thread; prints
ms/call, mean SM clock, mean power, energy per call and the throttle reasons seen.
Also prints the cuBLAS kernel names from a profiler trace.
"""

import collections
import glob
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import jax
import jax.numpy as jnp
import pynvml

from tessera_jax.pallas_kernels import matmul_configs as mc
from tessera_jax.pallas_kernels import matmul_mgpu as mg

pynvml.nvmlInit()
H = pynvml.nvmlDeviceGetHandleByIndex(0)
print(
    "power limit (enforced) W:",
    pynvml.nvmlDeviceGetEnforcedPowerLimit(H) / 1000,
    "default",
    pynvml.nvmlDeviceGetPowerManagementDefaultLimit(H) / 1000,
)
print(
    "max sm clock",
    pynvml.nvmlDeviceGetMaxClockInfo(H, pynvml.NVML_CLOCK_SM),
    "app clock",
    pynvml.nvmlDeviceGetApplicationsClock(H, pynvml.NVML_CLOCK_SM),
)
REASONS = {
    getattr(pynvml, n): n.replace("nvmlClocksThrottleReason", "")
    for n in dir(pynvml)
    if n.startswith("nvmlClocksThrottleReason") and n[24:] not in ("All", "None", "Unknown")
}


def reasons(mask):
    return (
        "+".join(v for k, v in REASONS.items() if isinstance(k, int) and k and mask & k) or "none"
    )


def sample(stop, out):
    while not stop.is_set():
        clk = pynvml.nvmlDeviceGetClockInfo(H, pynvml.NVML_CLOCK_SM)
        pw = pynvml.nvmlDeviceGetPowerUsage(H) / 1000
        tmp = pynvml.nvmlDeviceGetTemperature(H, pynvml.NVML_TEMPERATURE_GPU)
        try:
            r = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(H)
        except Exception:
            r = 0
        out.append((clk, pw, tmp, r))
        time.sleep(0.05)


def run(name, f, args, seconds=float(os.environ.get("SECS", "3"))):
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < 0.5:
        jax.block_until_ready(f(*args))
        n += 1
    samples, stop = [], threading.Event()
    th = threading.Thread(target=sample, args=(stop, samples))
    th.start()
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < seconds:
        for _ in range(20):
            out = f(*args)
        jax.block_until_ready(out)
        n += 20
    dt = (time.perf_counter() - t) / n
    import subprocess

    q = subprocess.run(["nvidia-smi", "-q", "-d", "POWER"], capture_output=True, text=True).stdout
    mem = (
        q.split("GPU Memory Power Readings")[1]
        .split("Average Power Draw")[1]
        .split(":")[1]
        .split("\n")[0]
        .strip()
        if "GPU Memory Power Readings" in q
        else "?"
    )
    stop.set()
    th.join()
    s = samples[len(samples) // 5 :]
    clk = statistics.mean(x[0] for x in s)
    pw = statistics.mean(x[1] for x in s)
    rs = collections.Counter(reasons(x[3]) for x in s)
    print(
        f"{name:34s} {dt * 1e3:.4f} ms {2 * 8192**3 / dt / 1e12:6.1f} TF/s  sm {clk:.0f} MHz  {pw:.0f} W  "
        f"{pw * dt * 1e3:.1f} mJ/call  temp {s[-1][2]} C  mem {mem}  reasons {dict(rs)}",
        flush=True,
    )
    return dt


BF = jnp.bfloat16
a = (jax.random.normal(jax.random.key(1), (8192, 8192), jnp.float32)).astype(BF)
b = (jax.random.normal(jax.random.key(2), (8192, 8192), jnp.float32)).astype(BF)
xla = jax.jit(lambda a, b: jnp.dot(a, b))
impls = {"xla": xla}
base = mc.CANDIDATES["bf16_128x256x64_s4"]
C = mc.CANDIDATES["bf16_128x256x64_s4"]
VARIANTS = {
    "default 128x256 wg-n w8": C,
    "wg-m cluster-m": C.replace(wg_dimension="m", cluster_dimension="m"),
    "wg-m cluster-m dr1": C.replace(wg_dimension="m", cluster_dimension="m", delay_release=1),
    "wg-m cluster-m w4": C.replace(wg_dimension="m", cluster_dimension="m", grid_tile_width=4),
    "wg-m dr1": C.replace(wg_dimension="m", delay_release=1),
    "256x128 wg-m cluster-n dr1": C.replace(
        block_m=256, block_n=128, wg_dimension="m", cluster_dimension="n", delay_release=1
    ),
}
if os.environ.get("VARIANTS"):
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in os.environ["VARIANTS"].split(",")}
for name, cfg in VARIANTS.items():
    impls[name] = jax.jit(lambda a, b, cfg=cfg: mg.matmul(a, b, out_dtype=BF, config=cfg))
ref = xla(a, b).astype(jnp.float32)
for k, f in list(impls.items()):
    try:
        e = float(jnp.linalg.norm(f(a, b).astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        print(k, "rel diff vs xla", e, flush=True)
    except Exception as ex:
        print("!!", k, type(ex).__name__, str(ex)[:300])
        impls.pop(k)
for rep in range(int(os.environ.get("REPS", "2"))):
    for k, f in impls.items():
        run(k, f, (a, b))

# cuBLAS kernel names
try:
    d = "/tmp/prof"
    with jax.profiler.trace(d):
        for _ in range(3):
            jax.block_until_ready(xla(a, b))
            jax.block_until_ready(impls["default 128x256 wg-n w8"](a, b))
    f = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(f)
    names = collections.Counter()
    for plane in pd.planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            for ev in line.events:
                names[(ev.name[:150], round(ev.duration_ns / 1e3))] += 1
    for (nm, us), c in names.most_common(12):
        print(f"  kernel {us} us x{c}: {nm}")
except Exception as ex:
    print("profile failed:", type(ex).__name__, str(ex)[:300])
