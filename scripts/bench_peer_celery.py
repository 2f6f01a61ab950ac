"""The Celery peer of agentscope-bench's W1 (scripts/bench-peer-celery.sh runs it).

Celery 5 with the machine's Redis (127.0.0.1:6379) as broker and result backend, a worker with
the threads pool (16). Same shapes as `agentscope-bench low` and `bulk`:

- low: one task at a time: submit, wait for its result, next; submit -> task body started
  (time.time_ns() as the task's first statement, the wall clock the benchmark reads too).
- bulk: N no-op tasks from 32 submitter threads; tasks/s = N / (last task end - first submit).

With --spawn the task body also runs `true` as a child process (agentscope spawns a provider per
attempt). Nothing is durable here: Redis as configured on this machine, results kept 5 minutes.
JSON on stdout (each round and the medians), a summary on stderr.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid

from celery import Celery

BROKER = os.environ.get("BENCH_PEER_REDIS", "redis://127.0.0.1:6379/11")
QUEUE = os.environ.get("BENCH_PEER_QUEUE", "bench-peer")
app = Celery("bench_peer_celery", broker=BROKER, backend=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    result_expires=300,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
)


@app.task(name="bench.noop")
def noop(spawn):
    start = time.time_ns()
    if spawn:
        subprocess.run(["true"], check=True)
    return [start, time.time_ns()]


def pct(values, p):
    v = sorted(values)
    if not v:
        return None
    return round(v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))], 3)


def summary(values):
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p99": pct(values, 99),
        "max": round(max(values), 3) if values else None,
        "mean": round(statistics.fmean(values), 3) if values else None,
    }


def cpu_s(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    hz = os.sysconf("SC_CLK_TCK")
    return sum(int(rest[i - 3]) for i in (14, 15, 16, 17)) / hz


def start_worker(concurrency):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=here)
    w = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench_peer_celery", "worker", "-P", "threads",
         "-c", str(concurrency), "-Q", QUEUE, "-l", "warning", "--without-heartbeat",
         "--without-gossip", "--without-mingle", "-n", f"peer-{uuid.uuid4().hex[:8]}@%h"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    noop.delay(False).get(timeout=60)  # ready
    return w


def low(tasks, spawn, worker):
    for _ in range(10):
        noop.delay(spawn).get(timeout=30)
    c0, w0 = cpu_s(os.getpid()) + 0, cpu_s(worker.pid)
    to_start = []
    for _ in range(tasks):
        t0 = time.time_ns()
        start, _end = noop.delay(spawn).get(timeout=30)
        to_start.append((start - t0) / 1e6)
    return {
        "tasks": tasks,
        "submit_to_task_started_ms": summary(to_start),
        "worker_cpu_per_task_ms": round((cpu_s(worker.pid) - w0) * 1000 / tasks, 3),
        "client_cpu_per_task_ms": round((cpu_s(os.getpid()) - c0) * 1000 / tasks, 3),
    }


def bulk(tasks, submitters, spawn, worker):
    results = [None] * tasks
    t0s = [0] * tasks
    nxt = iter(range(tasks))
    lock = threading.Lock()

    def submit():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            t0s[i] = time.time_ns()
            results[i] = noop.delay(spawn)

    w0, c0 = cpu_s(worker.pid), cpu_s(os.getpid())
    first = time.time_ns()
    threads = [threading.Thread(target=submit) for _ in range(submitters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = [r.get(timeout=600) for r in results]
    last_end = max(e for _, e in out)
    window = (last_end - first) / 1e9
    return {
        "tasks": tasks,
        "submitters": submitters,
        "tasks_per_s": round(tasks / window, 3),
        "window_s": round(window, 3),
        "submit_to_task_started_ms": summary([(s - t0) / 1e6 for (s, _), t0 in zip(out, t0s)]),
        "worker_cpu_per_task_ms": round((cpu_s(worker.pid) - w0) * 1000 / tasks, 3),
        "client_cpu_per_task_ms": round((cpu_s(os.getpid()) - c0) * 1000 / tasks, 3),
    }


def median(rounds):
    if not rounds:
        return None
    first = rounds[0]
    if isinstance(first, dict):
        return {k: median([r.get(k) for r in rounds]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return round(statistics.median([r for r in rounds if r is not None]), 3)
    return first


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=["low", "bulk", "all"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--low-tasks", type=int, default=200)
    p.add_argument("--bulk-tasks", type=int, default=5000)
    p.add_argument("--submitters", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--spawn", action="store_true", help="the task runs `true` as a child")
    a = p.parse_args()
    names = ["low", "bulk"] if a.workload == "all" else [a.workload]
    rounds = {n: [] for n in names}
    for r in range(1, a.rounds + 1):
        for n in names:
            worker = start_worker(a.concurrency)
            try:
                if n == "low":
                    v = low(a.low_tasks, a.spawn, worker)
                    line = "submit->started p50 {p50} p99 {p99} ms".format(**v["submit_to_task_started_ms"])
                else:
                    v = bulk(a.bulk_tasks, a.submitters, a.spawn, worker)
                    line = "{} tasks/s; submit->started p50 {} ms".format(
                        v["tasks_per_s"], v["submit_to_task_started_ms"]["p50"])
            finally:
                worker.terminate()
                worker.wait()
            print(f"[{r}/{a.rounds}] celery {n}: {line}", file=sys.stderr)
            rounds[n].append(v)
    out = {
        "benchmark": "bench-peer-celery",
        "spawn": a.spawn,
        "concurrency": a.concurrency,
        "rounds": a.rounds,
        "workloads": {f"celery_{n}": {"median": median(v), "rounds": v} for n, v in rounds.items()},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
