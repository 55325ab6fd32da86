"""A decode graph's replay() on the host: how long the call takes at each batch size, and
whether it lets another Python thread run meanwhile (torch binds CUDAGraph.replay with the GIL
released). If a large graph's replay costs the host a few hundred microseconds, the engine could
replay from a second thread while the main one finishes the step before; this says whether that
is worth building. The graphs are replayed over their capture's inputs (empty sequences): a
launch's host cost does not depend on the data.

    python benchmarks/graph_replay_cost.py MODEL_DIR        (a GPU; bench-0.6b)
"""
import sys
import threading
import time

import torch

from asynct import LLM


def replay_us(graph, n=30):
    """Median, min and max host time of graph.replay(), the device idle before each call."""
    for _ in range(5):
        graph.replay()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[n // 2] * 1e6, ts[0] * 1e6, ts[-1] * 1e6


def thread_rate(fn, count, n=40):
    """Counts a spinning thread made while the main thread was inside fn, a second."""
    counted, busy = 0, 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        c0, t = count[0], time.perf_counter()
        fn()
        busy += time.perf_counter() - t
        counted += count[0] - c0
    return counted / busy


def main():
    llm = LLM(sys.argv[1], gpu_memory_utilization=0.45)
    graphs = llm.llm_engine.runner.graphs.graphs
    for bs in sorted(graphs):
        if bs in (1, 8, 32, 64, 128, 256) or bs == max(graphs):
            med, lo, hi = replay_us(graphs[bs])
            print(f"batch {bs:4d}: replay() host us median {med:7.1f} (min {lo:7.1f}, max {hi:7.1f})", flush=True)
    count, running = [0], [True]

    def spin():
        while running[0]:
            count[0] += 1
    threading.Thread(target=spin, daemon=True).start()

    def python_spin():
        t = time.perf_counter()
        while time.perf_counter() - t < 5e-4:
            pass
    graph = graphs[max(graphs)]
    for name, fn in (("replay (largest graph)", graph.replay), ("sleep 0.5 ms (GIL free)", lambda: time.sleep(5e-4)),
                     ("Python spin 0.5 ms (GIL held)", python_spin)):
        print(f"{name:30s}: another thread counted {thread_rate(fn, count) / 1e6:6.2f} M/s", flush=True)
    running[0] = False


if __name__ == "__main__":
    main()
