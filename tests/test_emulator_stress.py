"""Chapter 4, the CPU emulation under load: the barrier check reports divergence, never a busy machine.

cuda_emu.h runs the threads of a block as real threads. On a busy machine a thread can be descheduled
between arriving at a __syncthreads() and checking it; by the time it runs again the other threads may
have been released, passed the barrier and left the kernel. The check must then see that the barrier it
arrived at is no longer the current one and carry on; a check that only counts the threads that have
left reports a divergence that did not happen (a flaky suite on every 2-core laptop).

The tests widen that window on purpose (``race_window_us``: every waiting thread pauses between arriving
and checking) and launch both kernels many times beside two busy processes: with the old check every
launch fails, with the right one none does. A real divergence (the ``divergent_sync`` mutant) is still
reported with the window widened, so the fix did not blind the check.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from host_reference import host_attention

from minillm.kernels import build, launch
from minillm.kernels.mutants import write_kernel_mutant

pytestmark = [
    pytest.mark.host_only,
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ (C++20) is needed to emulate the kernels"),
]

LAUNCHES = 12  # per kernel; with the old check each one fails
RACE_WINDOW_US = 200  # long enough for the released threads to leave the kernel meanwhile
BUSY_PROCESSES = 2


@pytest.fixture(scope="module")
def busy_machine():
    """Two busy processes beside the launches, as on a student's laptop that is doing something else."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY_PROCESSES)]
    yield
    for p in procs:
        p.kill()
        p.wait()


def qkv(Tq, Tk, hs, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, Tq, hs)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, Tk, hs)).astype(np.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kernel", ["v1", "v2"])
def test_barrier_check_holds_on_a_busy_machine(busy_machine, kernel):
    """Many launches of the real kernels, every barrier's race window widened, beside two busy
    processes: no launch reports a divergence, and every output is the reference's."""
    q, k, v = qkv(40, 40, 32)
    ref, _ = host_attention(q, k, v, causal=True)
    launcher = launch.launch_emulated if kernel == "v1" else launch.launch_v2_emulated
    for _ in range(LAUNCHES):
        out, _, status = launcher(q, k, v, causal=True, race_window_us=RACE_WINDOW_US)
        assert status == 0
        np.testing.assert_allclose(out[..., : q.shape[-1]], ref, atol=1e-5)


def test_real_divergence_is_still_reported_with_the_window_widened(busy_machine):
    """A __syncthreads() inside `if (row_valid)` (a tail tile of 33 rows, so one thread skips it) still
    fails the launch, naming the divergence, when every waiting thread pauses before its check."""
    mutant = write_kernel_mutant("divergent_sync", build.KERNEL_SOURCE, Path(tempfile.mkdtemp()))
    q, k, v = qkv(33, 33, 16)
    with pytest.raises(build.KernelError, match="diverged"):
        launch.launch_emulated(q, k, v, causal=True, source=mutant, race_window_us=RACE_WINDOW_US)
