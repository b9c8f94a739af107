"""Process helpers shared by the multi-process tests (tensor and context parallelism, CPU and GPU).

`free_port()`: a free TCP port on 127.0.0.1 for a process group's rendezvous.
`run_ranks(worker, world, *args, timeout_s)`: runs `worker(rank, port, *args, results)` in `world` spawned processes,
each putting `(rank, "ok", result)` or `(rank, "error", traceback)` on `results`; returns {rank: result}. It fails the
test with the rank's traceback, or after `timeout_s` without a result (never hangs), and kills what it started.
"""
from __future__ import annotations

import queue
import socket

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, *args, timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, *args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, status, res = results.get(timeout=timeout_s)
            assert status == "ok", f"rank {rank} failed:\n{res}"
            out[rank] = res
    except queue.Empty:
        pytest.fail(f"workers gave no result within {timeout_s} s (ranks done: {sorted(out)})")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out
