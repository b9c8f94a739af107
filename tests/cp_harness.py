"""Multi-process context parallelism on CPU (gloo), for tests/test_context_parallel.py.

`spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` processes joined in one gloo
process group (MASTER_ADDR=127.0.0.1, a free port); an exception in any rank fails the call with that rank's
traceback.

`cpu_accelerator()`: diffusers' `ModelMixin.enable_parallelism` refuses a machine without an accelerator in one line
of `_resolve_parallel_config`, `rank % torch.accelerator.device_count()` (0 on CPU). Inside this context
`device_count()` is 1, so diffusers' own `enable_parallelism` runs unchanged on CPU: the device type is
`torch._C._get_accelerator()` ("cpu"), the mesh `init_device_mesh("cpu", (ring, ulysses))` over the gloo group,
then `ContextParallelConfig.setup`, each processor's `_parallel_config`, and `apply_context_parallel(model, cp_config,
plan)`. Running diffusers' code rather than a copy of it keeps the test honest when diffusers changes.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.multiprocessing as mp

from tests.multiproc import free_port


def _entry(rank, world_size, port, fn, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # The rank passed: leave without the interpreter's finalization, whose C++ teardown (the device mesh's gloo and
    # store threads) once aborted a rank in CI (SIGABRT, "terminate called without an active exception", no Python
    # exception), which mp.spawn reports as a failed test. run_ranks' tests judge the ranks' results the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world_size: int, *args) -> None:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks (fn must be importable: a module-level function).
    The free port is found before the ranks bind it, so another process can take it in between: only that failure
    is retried, with a new port."""
    for attempt in range(3):
        try:
            mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
            return
        except mp.ProcessRaisedException as e:
            if attempt == 2 or "address already in use" not in str(e).lower():
                raise


@contextlib.contextmanager
def cpu_accelerator():
    """Let diffusers' enable_parallelism run on a CPU-only machine (module docstring)."""
    orig = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = orig


def enable_parallelism(model, **cp_kwargs):
    """diffusers' `model.enable_parallelism(config=ContextParallelConfig(**cp_kwargs))` on CPU."""
    from diffusers import ContextParallelConfig

    with cpu_accelerator():
        model.enable_parallelism(config=ContextParallelConfig(**cp_kwargs))
    return model
