"""The intra-op threads of a run on the CPU: the idle cores, not torch's one per core (OpenMP's threads wait on each
other: on 2 cores with one busy, 8x slower steps), unless the user chose; the count sets the kernels' float order."""

from __future__ import annotations

import glob
import os
import time

import torch

_CHOSEN: int | None = None  # lwm's choice in this process


def physical_cores() -> int | None:
    """The machine's physical cores (what torch starts with), from sysfs; None where it cannot tell."""
    cores = set()
    for topology in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            return None
    return len(cores) or None


def idle_cpus(cpus: set[int], seconds: float = 0.25) -> float:
    """How many of ``cpus`` were idle over the next ``seconds`` (what other processes leave), from ``/proc/stat``."""
    def times() -> dict[str, tuple[int, int]]:  # cpuN -> (idle + iowait, all) jiffies
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
                    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                    out[name] = (values[3] + values[4], sum(values))
        return out

    before = times()
    time.sleep(seconds)
    after = times()
    return sum((after[k][0] - before[k][0]) / max(1, after[k][1] - before[k][1]) for k in after if k in before)


def threads_for(idle: float, cores: int) -> int:
    """The threads for ``idle`` cores out of ``cores``: the idle ones, rounded half up, at least 1."""
    return max(1, min(cores, int(idle + 0.5)))


def set_cpu_threads(processes: int = 1) -> str:
    """Set torch's intra-op threads for ``processes`` (DDP ranks) on this machine's CPU -> how many and why."""
    global _CHOSEN
    n = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{n} (OMP_NUM_THREADS)"
    if _CHOSEN is None and n not in {physical_cores(), os.cpu_count()}:
        return f"{n} (torch.set_num_threads before lwm; OMP_NUM_THREADS=N sets them)"
    if _CHOSEN is None:
        try:
            cpus = os.sched_getaffinity(0)
            idle = idle_cpus(cpus)
        except (AttributeError, OSError, ValueError):  # not Linux: torch's count
            return f"{n} (OMP_NUM_THREADS=N sets them)"
        _CHOSEN = max(1, threads_for(idle, min(n, len(cpus))) // processes)
        why = f"{len(cpus)} cores, {len(cpus) - idle:.1f} of them in use by other processes"
        if processes > 1:  # Lightning's launcher, and the ranks it starts, keep it
            os.environ["OMP_NUM_THREADS"] = str(_CHOSEN)
            why += f", shared by {processes} processes"
    else:
        why = "as the run before in this process"
    torch.set_num_threads(min(n, _CHOSEN))
    return f"{torch.get_num_threads()} ({why}; OMP_NUM_THREADS=N sets them)"
