"""The leader process alone: the leader scenario of `python -m
multiworld_rs.bench` with the leader run in this process (threads or
asyncio) and the benchmark's own worker ranks, reporting the leader's rate
and its CPU per message (user and system time of all its threads, from
`getrusage` around the timed part), the whole machine's CPU per message
(busy and idle, every process: `/proc/stat` around the timed part, so run
it on an otherwise quiet machine), and, with `--perf`, its system calls
and context switches per message (`perf stat -p` on this process during
the timed part; needs `perf`). `--leaves-held 0|1` sets
`multiworld_rs.loop_leaves_held` for the run (default: the package's).

    target/py-venv/bin/python bench/leader_process_cpu.py [--mode asyncio|threads]
        [--workers 2] [--size 65536] [--gib 2] [--read-ahead BYTES]
        [--leaves-held 0|1] [--perf] [--repeats 1]

Needs the package (`MW_PY_RELEASE=1 bash crates/multiworld-py/scripts/test.sh`
builds and installs it into `target/py-venv`).
"""

import argparse
import asyncio
import os
import resource
import signal
import subprocess
import threading
import time
from typing import Any, Dict, Optional, Tuple

from _common import LeaderRun
from multiworld_rs import bench as b
from multiworld_rs.aio import AsyncWorld


def machine_cpu() -> Optional[Tuple[float, float]]:
    """Seconds of busy and idle CPU, all CPUs together, since boot
    (`/proc/stat`: user to softirq; a VM's steal time is left out, and
    with `--perf` perf's own CPU counts as busy); `None` where there is no
    such file."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    if len(fields) < 7:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / tick, idle / tick


def one_run(mode: str, workers: int, size: int, load: "Optional[b.Load]" = None,
            read_ahead: Optional[int] = None, perf: bool = False,
            leaves_held: Optional[bool] = None) -> Dict[str, Any]:
    """One run: the leader's GB/s and its CPU (and, with `perf`, system
    calls and context switches) per message, and the machine's busy and
    idle CPU per message, as a dict."""
    opts = {} if read_ahead is None else {"read_ahead": read_ahead}
    counter: "Optional[subprocess.Popen[str]]" = None

    def start():
        nonlocal counter
        if perf:
            counter = subprocess.Popen(["perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter,context-switches",
                                        "-p", str(os.getpid())], stderr=subprocess.PIPE, text=True)
            time.sleep(0.3)  # attached before the clock starts
        return resource.getrusage(resource.RUSAGE_SELF), machine_cpu(), time.perf_counter()

    def stop(r0, m0, t0):
        secs = time.perf_counter() - t0
        r1, m1 = resource.getrusage(resource.RUSAGE_SELF), machine_cpu()
        out = ""
        if counter is not None:
            counter.send_signal(signal.SIGINT)
            out = counter.communicate()[1]
        machine = None if m0 is None or m1 is None else (m1[0] - m0[0], m1[1] - m0[1])
        return secs, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, machine, out

    setting = None
    if leaves_held is not None:
        import multiworld_rs as mw

        setting = mw.loop_leaves_held()
        mw.loop_leaves_held(leaves_held)
    try:
        return _measured(mode, workers, size, load, opts, start, stop)
    finally:
        if setting is not None:
            mw.loop_leaves_held(setting)


def _measured(mode, workers, size, load, opts, start, stop) -> Dict[str, Any]:
    """The run itself (see `one_run`), timed by `start` and `stop`."""
    with LeaderRun(workers, size, load, **opts) as run:
        if mode == "asyncio":
            async def main():
                aws = [AsyncWorld(w) for w in run.worlds]

                async def receive(aw, buf):
                    for _ in range(run.count):
                        await aw.recv_into(buf, 1, b._DATA)

                r0, m0, t0 = start()
                for aw in aws:
                    await aw.send(run.go, 1, b._GO)
                await asyncio.gather(*(receive(aw, x) for aw, x in zip(aws, run.bufs)))
                return stop(r0, m0, t0)

            secs, user, system, machine, out = asyncio.run(main())
        else:
            errors = []

            def receive(w, buf):
                try:
                    for _ in range(run.count):
                        w.recv_into(buf, 1, b._DATA)
                except BaseException as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=receive, args=(w, x)) for w, x in zip(run.worlds, run.bufs)]
            for t in threads:
                t.start()
            r0, m0, t0 = start()
            for w in run.worlds:
                w.send(run.go, 1, b._GO)
            for t in threads:
                t.join()
            secs, user, system, machine, out = stop(r0, m0, t0)
            if errors:
                raise errors[0]
    n = run.count * workers
    r: Dict[str, Any] = {"mode": mode, "workers": workers, "size": size, "messages": n,
                         "gb_per_s": n * size / secs / 1e9, "user_us": user / n * 1e6, "system_us": system / n * 1e6}
    if machine is not None:
        r["machine_busy_us"], r["machine_idle_us"] = machine[0] / n * 1e6, machine[1] / n * 1e6
    for row in out.splitlines():
        parts = row.split(",")
        if len(parts) > 2 and parts[0].strip().isdigit():
            r[parts[2]] = int(parts[0]) / n
    return r


def describe(r: Dict[str, Any]) -> str:
    line = (f"{r['mode']}, {r['workers']} workers, {r['size']} B: {r['gb_per_s']:.2f} GB/s; leader per message: "
            f"user {r['user_us']:.1f} us, system {r['system_us']:.1f} us")
    if "machine_busy_us" in r:
        line += f"; machine per message: busy {r['machine_busy_us']:.1f} us, idle {r['machine_idle_us']:.1f} us"
    for k in ("raw_syscalls:sys_enter", "context-switches"):
        if k in r:
            line += f", {k} {r[k]:.2f}"
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("asyncio", "threads"), default="asyncio")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", type=int, default=64 << 10)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--read-ahead", type=int, default=None, help="the leader's worlds' read_ahead")
    p.add_argument("--leaves-held", type=int, choices=(0, 1), default=None,
                   help="multiworld_rs.loop_leaves_held for the run (default: the package's)")
    p.add_argument("--perf", action="store_true", help="system calls and context switches (perf stat)")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    load = b.Load(bytes=int(a.gib * (1 << 30)))
    for i in range(a.repeats):
        held = None if a.leaves_held is None else bool(a.leaves_held)
        r = one_run(a.mode, a.workers, a.size, load, a.read_ahead, a.perf, held)
        print(f"run {i + 1}: {describe(r)}", flush=True)


if __name__ == "__main__":
    main()
