"""An extension: how many torch threads a CPU engine runs, when threads= is not given. On a CPU, more torch threads
than free cores is ruinous: each parallel region of an operator waits for its slowest thread, and a thread that shares
its core with another busy process runs a fraction of the time, so the whole region waits for it (example.py fell from
60 to 1.4 tok/s beside two busy processes, README's "CPU threads"). So the engine takes the cores that other processes
leave free when it starts, measured here; with tensor parallelism on a CPU, the ranks share them.

The model runner asks for it once, when it starts on a CPU. Without this file the engine keeps torch's own count (one
thread per core), which is right on an idle machine."""

import os
import time

LOOKS, LOOK_INTERVAL_S = 5, 0.01  # /proc/loadavg is read this many times, this far apart: the fewest running counts


def running_processes() -> int:
    """Linux: the processes running right now, this one included ("0.52 0.58 0.59 running/total last_pid")."""
    time.sleep(LOOK_INTERVAL_S)
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def free_cores() -> int:
    """Cores this process may use that other processes are not busy on. Linux says how many are busy (/proc/loadavg's
    running count, at its fewest of a few looks, less this process); elsewhere every core counts as free (pass
    threads= on a busy machine)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not os.path.exists("/proc/loadavg"):
        return cores
    busy = min(running_processes() for _ in range(LOOKS)) - 1
    return max(1, cores - busy)


def threads_per_rank(num_ranks: int) -> int:
    """Each rank's share of the free cores (one rank without tensor parallelism), at least one."""
    return max(1, free_cores() // num_ranks)
