"""Shared timing and peer code of the benchmarks: one place for the CUDA-event loops, the SDPA backend forcing, the
per-kernel profile, TOPS and the run's metadata, so that every benchmark measures the same way.

Three ways of timing a call, chosen by what the number is for:
- `bench_ms`: one call at a time, median (triton's do_bench when present: L2 flushed between calls; else an event
  loop with the same warm-up/repeat policy). The kernel tables use it.
- `burst_ms`: bursts of calls between two events, median per call. Hides host gaps, as when a pipeline runs ahead
  of the GPU.
- `counted_ms`: a given number of calls after a given number of warm-up calls, per-call times (L2 flushed before
  each, no host sync between calls). For calls of tens of ms to seconds (attention forward + backward at long
  sequences), where a time budget would mean one or two repeats.
`Timer` / `Clock` time whole model forwards (CUDA events on a GPU, perf_counter on CPU, so --tiny smoke tests run).

Importing this module needs torch only; nothing here touches the GPU until called.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable

import torch

# the repository root on sys.path: the benchmarks run from a checkout without installing the package
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

PEERS = ("flash", "cudnn", "math", "efficient")


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


@contextmanager
def forced_sdpa(name: str):
    """torch SDPA restricted to one backend ("flash" = FlashAttention-2, "cudnn", "math", "efficient"): a peer
    that is not available for the shape raises instead of silently falling back to another backend."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_backend(name)]):
        yield


def sdpa_fn(backend: str, q, k, v, causal: bool = False, **kw) -> Callable:
    """A zero-argument call of torch SDPA forced to `backend` (a peer of the same run)."""
    f = torch.nn.functional.scaled_dot_product_attention

    def call():
        with forced_sdpa(backend):
            return f(q, k, v, is_causal=causal, **kw)

    return call


def bench_ms(fn: Callable, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median ms of one call: triton.testing.do_bench when triton is installed, else a CUDA-event loop with the
    same warm-up and repeat budget."""
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        pass
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        fn()
    e.record()
    e.synchronize()
    est = max(s.elapsed_time(e) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    times = []
    for _ in range(max(3, int(rep_ms / est))):
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def burst_ms(fn: Callable, n: int = 20, reps: int = 15, warmup: int = 5) -> float:
    """Median ms per call over `reps` bursts of `n` calls between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times)


def counted_ms(fn: Callable, warmup: int, reps: int, device="cuda", flush_l2: bool = True) -> list:
    """ms of each of `reps` calls of `fn` after `warmup` untimed ones. On a GPU: a CUDA-event pair around each call,
    L2 flushed before it (a 256 MiB memset, as do_bench), no host sync between calls (the host runs ahead, as in a
    training loop); on CPU: perf_counter around each call."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        if cache is not None:
            cache.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


class Clock:
    """Time marks on the device's clock: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Timer(Clock):
    """`timer(fn, warmup, iters)` -> list of ms, one per call (for forwards that take milliseconds or more)."""

    def __call__(self, fn: Callable, warmup: int, iters: int) -> list:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            a = self.mark()
            fn()
            times.append(self.ms(a, self.mark()))
        return times


def kernel_split(fn: Callable, calls: int = 5, warmup: int = 3) -> dict:
    """Device ms per call of each CUDA kernel `fn` launches (torch.profiler), keyed by the kernel's short name,
    plus "total". With programmatic dependent launch a kernel's time includes its wait for its predecessor."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for ev in prof.events():
        # "kernel" in any case: CUDA C++ kernels are often CamelCase (QuantInt8Kernel); memcpy/memset events have none
        if not str(ev.device_type).endswith("CUDA") or "kernel" not in ev.name.lower():
            continue
        m = re.search(r"(\w+_kernel|\w+Kernel)", ev.name)
        name = m.group(1) if m else ev.name[:40]
        out[name] = out.get(name, 0.0) + ev.device_time_total / calls / 1000.0
    out = {k: round(v, 4) for k, v in out.items()}
    out["total"] = round(sum(out.values()), 4)
    return out


def tops(b: int, h: int, n: int, d: int, causal: bool, ms: float, n_kv: int | None = None) -> float:
    """4*B*H*Nq*Nkv*D / time in TOPS, halved for causal (the convention of FlashAttention's and SageAttention's
    plots, so the numbers compare with theirs)."""
    ops = 4.0 * b * h * n * (n_kv or n) * d * (0.5 if causal else 1.0)
    return ops / (ms * 1e-3) / 1e12


def require_cuda_kernels() -> None:
    """Exit with a message (not a traceback) when there is no GPU or the compiled kernels did not load."""
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (this benchmark times the compiled kernels)")
    import sage_patch.kernels as K

    st = K.status()
    if not st["loaded"]:
        sys.exit(f"compiled kernels not usable: {st['reason']}")


def run_meta(**extra) -> dict:
    """What a result must carry to be reproduced: date, GPU, versions, kernel library, command line."""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
            "command": " ".join([os.path.relpath(sys.argv[0], _ROOT) if sys.argv and sys.argv[0] else ""]
                                + sys.argv[1:])}
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cc"] = "".join(map(str, torch.cuda.get_device_capability()))
    try:
        import sage_patch.kernels as K

        meta["kernels"] = K.status().get("reason")
    except Exception as e:  # a broken build must not hide the numbers of the peers
        meta["kernels"] = f"{type(e).__name__}: {e}"
    meta.update(extra)
    return meta
