"""A pooling model's instances (Triton's `instance_group { count }`): worker threads that each run
whole batches, with the CPU's threads split between them.

Why more than one on a CPU: one instance runs its forward on an OpenMP team of every core, and
each of the ~60 ops of a BERT forward is a parallel region that ends with its slowest thread.
On a small machine shared with the HTTP event loop (about 1 ms of CPU per request when this was
measured; 0.27 ms with the pure-ASGI endpoints), the loop
preempting one team member stalls the whole team, and between regions the workers sleep
(OMP_WAIT_POLICY=PASSIVE, cpu_runtime.py) and must be woken. Two instances of one thread each
have no team to wait for: on 2 cores the same MiniLM-shaped encoder ran 446 passages/s as two
single-threaded instances at batch 16 against 383/s as one two-thread instance at batch 32
(benchmarks/pooling_instances_cpu.py; docs/benchmarks.md, "Embeddings on CPU"). On a GPU the instances would only queue on one
device, so the default there is one.

Each instance thread sets its own OpenMP thread count once, when it starts: libgomp keeps that
count per thread, and torch and Stoker's C kernels (which pass torch.get_num_threads()) read the
calling thread's. torch.set_num_threads also rewrites the process-wide default that a thread
adopts on its first parallel op, so that default is put back from a short-lived thread (whose
own count does not matter), leaving other models' threads (a chat engine in the same server)
with the machine's count.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

# The default on CPU: two instances (measured on 2 cores, above); more cores are split between
# the two, keeping each forward's latency close to one instance's.
DEFAULT_CPU_INSTANCES = 2


def resolve_instance_count(requested: int | None, device: torch.device, num_threads: int) -> int:
    """`requested` as given (PoolingModelSpec checked it is >= 1); None: 1 on a GPU, else
    DEFAULT_CPU_INSTANCES capped by the threads."""
    if requested is not None:
        return requested
    if device.type != "cpu":
        return 1
    return max(1, min(DEFAULT_CPU_INSTANCES, num_threads))


def threads_per_instance(num_instances: int, num_threads: int) -> int:
    """The CPU's threads split evenly between the instances, at least one each."""
    return max(1, num_threads // num_instances)


def _set_thread_count(num_threads: int, process_default: int) -> None:
    torch.get_num_threads()  # this thread's count starts from the process default (torch's lazy init) ...
    torch.set_num_threads(num_threads)  # ... and is now this instance's
    restore = threading.Thread(target=torch.set_num_threads, args=(process_default,), name="stoker-omp-default")
    restore.start()
    restore.join()


def instance_executor(num_instances: int, num_threads: int, name: str = "stoker-pooling") -> ThreadPoolExecutor:
    """`num_instances` worker threads, each running torch (and the C kernels) on `num_threads` threads."""
    return ThreadPoolExecutor(num_instances, thread_name_prefix=name, initializer=_set_thread_count,
                              initargs=(num_threads, torch.get_num_threads()))
