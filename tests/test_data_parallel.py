"""Data parallel on the CPU: N=2 engine processes give what one engine gives, in input order; a
killed engine fails its own requests alone; the server with two engines under a load of streams
(some leaving early) loses nothing and leaves every engine's blocks free."""
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asynct import LLM, SamplingParams
from asynct.engine.core_client import CoreClient, engine_args, gpus_for
from asynct.engine.engine_args import EngineArgs
from asynct.engine.llm_engine import LLMEngine
from asynct.engine.prefix_routing import PrefixHomes, assign, pick_engine, prefix_keys
from asynct.entrypoints.serve.api_server import make_app
from asynct.entrypoints.serve.launch import ServerThread
from test_server_load import MAX_TOKENS, run_load, wait_idle

ENGINE = dict(max_num_seqs=4, num_kv_blocks=256)
SHARED = "All of these questions share this first block of text. "


def mixed_batch():
    prompts = [SHARED + q for q in ("What is 2+2?", "Name a colour.", "Why?")] + \
        ["hi", "a somewhat longer prompt that fills more than one block of sixteen", [5, 6, 7, 8, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    params = [greedy, SamplingParams(temperature=0.9, n=2, seed=7, max_tokens=10),
              SamplingParams(temperature=0, max_tokens=20, logprobs=2), greedy,
              SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    return prompts, params


def summary(out):
    return (out.prompt, out.prompt_token_ids, out.error,
            [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs])


@pytest.fixture(scope="module")
def dp_llm(tiny_ckpt):
    llm = LLM(tiny_ckpt, data_parallel_size=2, seed=0, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_assign_balances_work_and_keeps_prefixes_together():
    # three prompts on one first block, three alone: the group stays whole, the rest balance it
    keys = ["p", "p", "p", 1, 2, 3]
    chosen = assign([10, 10, 10, 10, 10, 10], keys, [0, 0])
    assert len({chosen[0], chosen[1], chosen[2]}) == 1 and sorted(chosen).count(0) == 3
    # one prefix shared by every request (a few-shot eval) is split into shares, not left on one
    chosen = assign([10] * 8, ["p"] * 8, [0, 0])
    assert sorted(chosen) == [0] * 4 + [1] * 4 and chosen == sorted(chosen)
    # work already in flight counts
    assert assign([5], ["q"], [100, 0]) == [1]
    # a key's home engine (its blocks cached there) wins while the load stays within the share
    assert assign([5, 5], ["q", "r"], [0, 0], {"q": [1], "r": [1]}) == [1, 0]
    assert assign([5], ["q"], [0, 0], {"q": [1]}) == [1]         # alone: one piece of imbalance
    assert assign([5], ["q"], [100, 0], {"q": [0]}) == [1]
    # the deepest prefix's engine too busy: the next home (a shallower prefix's) before the least-loaded
    assert assign([5], ["q"], [100, 20, 0], {"q": [0, 1]}) == [1]
    assert assign([5], ["q"], [100, 90, 0], {"q": [0, 1]}) == [2]


def test_prefix_keys_name_the_cacheable_blocks_and_homes_find_the_deepest():
    """A key per full block (the last one too: the engine caches it once the prompt has run),
    each naming all blocks up to it; the homes give the deepest key a live engine holds, the
    least loaded of its holders, and every holder deepest first."""
    shared, q1, q2 = [1] * 32, [2] * 16, [3] * 16
    a, b = prefix_keys(shared + q1 + [7], 16), prefix_keys(shared + q2 + [8, 9], 16)
    assert len(a) == len(b) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert prefix_keys([1] * 15, 16) == [] and prefix_keys([1] * 16, 16) == prefix_keys([1] * 17, 16)
    assert prefix_keys(shared + q1, 16) == a        # a block-aligned prompt names its last block
    assert prefix_keys(q1 + shared + [7], 16)[1] != a[1]      # same block, other blocks before it
    homes = PrefixHomes()
    homes.remember(a, 0)
    homes.remember(b, 1)
    homes.remember(b[:2], 0)
    assert homes.deepest(a, [5, 0], [0, 1]) == (a[2], 0)      # a's own block: on 0 only
    assert homes.deepest(b, [0, 5], [0, 1]) == (b[2], 1)
    assert homes.deepest(b, [0, 5], [0]) == (b[1], 0)         # 1 dead: the shared blocks, on 0
    assert homes.deepest(prefix_keys([4] * 40, 16), [0, 0], [0, 1]) == (None, None)
    assert homes.holders(a, [0, 0], [0, 1]) == [0] and homes.holders(b, [0, 5], [0, 1]) == [1, 0]
    assert homes.holders(b, [0, 5], [0]) == [0]
    small = PrefixHomes(limit=3)
    small.remember(a, 0)
    small.remember(b, 1)       # b's first two keys are a's, refreshed: a's own third is the oldest
    assert list(small.engines) == b[::-1] and small.engines[b[0]] == [0, 1]   # shallow keys go last


def test_pick_engine_keeps_a_prefix_where_it_is_cached_while_balanced():
    """The server's choice, one request at a time: a prefix's engine takes it up to a slack of a
    quarter of the mean load (at least one request) over the least-loaded engine; past that the
    least-loaded takes it and holds the prefix too; dead engines and forgotten keys count not."""
    homes, a, b = PrefixHomes(limit=2), prefix_keys([1] * 17, 16), prefix_keys([2] * 17, 16)
    assert pick_engine(a, [0, 0], [0, 1], homes) == 0
    assert pick_engine(b, [1, 0], [0, 1], homes) == 1
    assert pick_engine(a, [4, 5], [0, 1], homes) == 0
    assert pick_engine(b, [4, 5], [0, 1], homes) == 1       # one over the least: within the slack
    assert pick_engine(b, [4, 6], [0, 1], homes) == 0       # two over: the least-loaded, now b's too
    assert homes.engines[b[0]] == [1, 0] and pick_engine(b, [9, 6], [0, 1], homes) == 1
    assert homes.best(b[0], [0, 0], [0]) == 0 and homes.best(b[0], [0, 0], []) is None
    assert pick_engine(a, [30, 25], [0, 1], homes) == 0     # slack 55 // 8 = 6: 5 over, within
    assert pick_engine(a, [30, 20], [0, 1], homes) == 1     # 10 over: the least-loaded
    homes.remember(prefix_keys([3] * 17, 16), 0)      # a third key: the oldest (b's) is forgotten
    assert b[0] not in homes.engines
    assert pick_engine(prefix_keys([5], 16), [2, 1], [0, 1], homes) == 1 and len(homes.engines) == 2
    # the deepest holder too busy: a shallower prefix's holder within the slack, before the least-loaded
    homes, shot = PrefixHomes(), [8] * 32
    homes.remember(prefix_keys(shot + [9] * 16 + [1], 16), 0)
    homes.remember(prefix_keys(shot + [1], 16), 1)
    assert pick_engine(prefix_keys(shot + [9] * 16 + [2], 16), [10, 3, 2], [0, 1, 2], homes) == 1
    assert pick_engine(prefix_keys(shot + [9] * 16 + [2], 16), [3, 3, 2], [0, 1, 2], homes) == 0


def test_two_engines_equal_one(dp_llm, tiny_ckpt):
    prompts, params = mixed_batch()
    one = LLM(tiny_ckpt, **ENGINE).generate(prompts, params, use_tqdm=False)
    two = dp_llm.generate(prompts, params, use_tqdm=False)
    assert [summary(o) for o in two] == [summary(o) for o in one]
    for a, b in zip(one, two):
        assert [c.cumulative_logprob for c in b.outputs] == pytest.approx([c.cumulative_logprob for c in a.outputs])
    gen = [s["generation_tokens"] for s in dp_llm.llm_engine.snapshots]
    assert min(gen) > 0, gen             # both engines worked
    bad = dp_llm.generate([[10 ** 6], "fine"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert "outside the vocabulary" in bad[0].error and bad[1].error is None


def test_copies_of_a_prompt_sample_apart_on_two_engines(dp_llm):
    """Each engine draws unseeded samples from its own seed (LLM's seed + its index): seeded
    alike, the copies of a prompt that went to the second engine repeated the first's (a task's
    repeated samples came back in pairs)."""
    outs = dp_llm.generate(["hi"] * 8, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 8
    assert min(s["generation_tokens"] for s in dp_llm.llm_engine.snapshots) > 0   # both engines sampled


def test_engines_seeds_follow_their_index():
    args = EngineArgs(model="m", seed=5, data_parallel_size=3)
    assert [engine_args(args, i, 3).seed for i in range(3)] == [5, 6, 7]
    assert engine_args(args, 0, 1) is args and engine_args(EngineArgs(model="m"), 1, 2).seed is None


def test_a_prefix_goes_back_to_the_engine_that_cached_it(dp_llm):
    """Two contexts go to two engines; a later request on the second context (a question's next
    choice in a later generate call) goes where that context's blocks are cached."""
    first, second = [7] * 40 + [1, 2], [9] * 40 + [3, 4]
    params = SamplingParams(temperature=0, max_tokens=1)
    dp_llm.generate([{"prompt_token_ids": p} for p in (first, second)], params, use_tqdm=False)
    again = dp_llm.generate([{"prompt_token_ids": second[:-2] + [5, 6]}], params, use_tqdm=False)[0]
    assert again.error is None and again.num_cached_tokens == 32
    assert dp_llm.llm_engine.num_kv_blocks == 2 * ENGINE["num_kv_blocks"]   # all engines', as LLMEngine's


def test_a_questions_choices_follow_their_question_not_the_few_shot_prefix(dp_llm):
    """A few-shot task's choices in two calls, with lm-eval's parameters (the continuation's
    logprobs only): five contexts share two blocks of examples; each context's first choice runs first
    (E, A, D land on engine 0, B, C on engine 1), then the other choices of A-D. Each goes where
    its own question's block is cached, so every one takes all three blocks from the cache
    (grouped by the shared first block, some took only the two shared ones)."""
    shot = [61] * 32
    questions = {name: shot + [t] * 17 for name, t in zip("EABCD", range(70, 75))}
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=49)
    first = dp_llm.generate([{"prompt_token_ids": q + [1]} for q in questions.values()], params, use_tqdm=False)
    assert all(o.error is None for o in first)
    others = [{"prompt_token_ids": questions[n] + [c]} for n in "ABCD" for c in (2, 3, 4)]
    cached = [o.num_cached_tokens for o in dp_llm.generate(others, params, use_tqdm=False)]
    assert cached == [48] * 12, cached


def spawn_env_report(args):
    """Runs in the engine process: its environment comes back as the start-up error."""
    keys = ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")
    raise ValueError(" ".join(f"{k}={os.environ.get(k)}" for k in keys))


def test_engine_processes_get_their_gpu_and_multicast_off(monkeypatch):
    before = dict(os.environ)
    client = CoreClient(EngineArgs(model="unused"), spawn_env_report, index=1, gpu="3")
    with pytest.raises(ValueError, match="the engine process 1 .GPU 3. could not start: ValueError: CUDA_VISIBLE_DEVICES=3 "
                                         "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1"):
        client.wait_ready()
    assert dict(os.environ) == before        # set for the child alone
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus_for(EngineArgs(model="m"), 2) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert gpus_for(EngineArgs(model="m"), 3) == ["4", "6", "7"]
    with pytest.raises(ValueError, match="needs 4 GPUs; 3 visible"):
        gpus_for(EngineArgs(model="m"), 4)
    assert gpus_for(EngineArgs(model="m", device="cpu"), 2) == [None, None]


def spawn_exit(args):
    """Runs in the engine process: it dies while loading, sending nothing."""
    os._exit(3)


def test_an_engine_process_dying_while_loading_names_its_exit_code():
    """The exit closed the pipe, poll read it as ready, and recv raised a bare EOFError."""
    client = CoreClient(EngineArgs(model="unused"), spawn_exit)
    with pytest.raises(RuntimeError, match="the engine process exited with code 3 while loading"):
        client.wait_ready()


def test_killed_engine_fails_only_its_requests(dp_llm, tiny_ckpt):
    """SIGKILL one engine process mid-run: its requests come back with an error naming it, the
    other engine's finish in full, and the next call runs on the engine left (last in this module:
    it leaves the module's LLM with one engine)."""
    eng = dp_llm.llm_engine
    victim = eng.clients[1].proc

    def kill_when_running():
        while eng.snapshots[1]["generation_tokens"] == before:
            time.sleep(0.005)
        os.kill(victim.pid, signal.SIGKILL)

    before = eng.snapshots[1]["generation_tokens"]
    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    long = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    outs = dp_llm.generate([f"request {i}" for i in range(6)], long, use_tqdm=False)
    killer.join(timeout=5)
    failed = [o for o in outs if o.error]
    assert len(failed) == 3, [o.error for o in outs]
    assert all("engine process 1 exited (code -9)" in o.error for o in failed)
    assert all(o.outputs[0].finish_reason == "error" for o in failed)
    assert all(len(o.outputs[0].token_ids) == 600 for o in outs if not o.error)
    assert eng.num_kv_blocks == ENGINE["num_kv_blocks"]     # the dead engine's blocks went with it
    prompts, params = mixed_batch()
    after = dp_llm.generate(prompts, params, use_tqdm=False)
    one = LLM(tiny_ckpt, **ENGINE).generate(prompts, params, use_tqdm=False)
    assert [summary(o) for o in after] == [summary(o) for o in one]


def test_an_engine_that_died_idle_gets_no_new_requests(tiny_ckpt):
    """An engine killed between two calls: the next call's requests all go to the engine left
    (half of them failed, "exited while running this request", before it was noticed)."""
    llm = LLM(tiny_ckpt, data_parallel_size=2, **ENGINE)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([f"warm {i}" for i in range(4)], greedy, use_tqdm=False)
        victim = llm.llm_engine.clients[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        outs = llm.generate([f"request {i}" for i in range(8)], greedy, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 8, [o.error for o in outs]
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    finally:
        llm.llm_engine.shutdown()


def test_a_dropped_llm_stops_its_engines_and_unfreezes_the_heap(tiny_ckpt):
    """The parent's start-up heap is frozen while the engines' front end lives, as one engine's is;
    dropped, the front end stops its processes and is freed: its clients' callbacks held it through
    its own finalizer, so it lived, its processes running, until the script ended."""
    import gc
    import weakref
    from asynct.engine import startup_heap
    live = len(startup_heap.owners())
    llm = LLM(tiny_ckpt, data_parallel_size=2, **ENGINE)
    engine, procs = weakref.ref(llm.llm_engine), [c.proc for c in llm.llm_engine.clients]
    assert gc.get_freeze_count() > 10_000 and engine() in startup_heap.owners()
    del llm
    assert engine() is None and len(startup_heap.owners()) == live
    assert all(p.exitcode is not None for p in procs)


def test_ctrl_c_leaves_the_engine_processes_running(tiny_ckpt):
    """A terminal's Ctrl-C reaches every process of its group: each engine died of it (a
    KeyboardInterrupt traceback each), so an interrupted LLM.generate left no engine to go on with."""
    from multiprocessing.connection import wait
    # started as a background job, this process ignores SIGINT, and so would the engines
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        llm = LLM(tiny_ckpt, data_parallel_size=2, **ENGINE)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        procs = [c.proc for c in llm.llm_engine.clients]
        for p in procs:
            os.kill(p.pid, signal.SIGINT)
        assert not wait([p.sentinel for p in procs], timeout=3), [p.exitcode for p in procs]
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = llm.generate([f"request {i}" for i in range(4)], greedy, use_tqdm=False)
        assert [o.error for o in outs] == [None] * 4
    finally:
        llm.llm_engine.shutdown()


# holds one engine process running a long request; prints its pid once tokens come
HOLDER = """
import sys, time
from asynct.engine.core_client import CoreClient
from asynct.engine.engine_args import EngineArgs
from asynct.engine.sampling_params import SamplingParams
client = CoreClient(EngineArgs(model=sys.argv[1], max_num_seqs=4, num_kv_blocks=256))
client.wait_ready()
running = []
client.start(lambda msg: msg[0] == "outputs" and not running and running.append(print(client.proc.pid, flush=True)))
client.add(("r", [5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True), False))
time.sleep(300)
"""


# starts an engine on a long request, then just ends (no stop)
LEAVER = """
import sys
from asynct.engine.core_client import CoreClient
from asynct.engine.engine_args import EngineArgs
from asynct.engine.sampling_params import SamplingParams
client = CoreClient(EngineArgs(model=sys.argv[1], max_num_seqs=4, num_kv_blocks=256))
client.wait_ready()
client.start(lambda msg: None)
client.add(("r", [5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True), False))
print("leaving", flush=True)
"""


def test_a_script_that_ends_without_stopping_its_engine_exits(tiny_ckpt):
    """The engine process ignores SIGTERM (a process group's is for the front end to handle), and
    multiprocessing's exit handler ends daemonic children with SIGTERM, then waits for them: a
    script that ended without stopping its engine waited forever. They are stopped first."""
    done = subprocess.run([sys.executable, "-c", LEAVER, str(tiny_ckpt)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and "leaving" in done.stdout, done.stderr[-2000:]


def test_an_engine_whose_front_end_was_killed_exits_quietly(tiny_ckpt):
    """SIGKILL of the process holding an engine, mid-request: the engine exits by itself (its
    stderr, which it shares with the holder, closes), and without the BrokenPipeError traceback
    that its next output used to print."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tiny_ckpt)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    guard = threading.Timer(120, holder.kill)     # a holder that never gets going
    guard.start()
    engine_pid = None
    try:
        engine_pid = int(holder.stdout.readline())
        holder.kill()
        _, err = holder.communicate(timeout=60)   # till the engine, the pipe's last holder, is gone
    finally:
        guard.cancel()
        holder.kill()
        if engine_pid is not None and holder.returncode is None:
            os.kill(engine_pid, signal.SIGKILL)
    assert "Traceback" not in err, err[-3000:]


class LoadingForever(LLMEngine):
    """An engine still loading its weights (minutes onto a GPU)."""

    def __init__(self, args):
        time.sleep(300)


LOADING_HOLDER = """
import sys, time
sys.path.insert(0, "tests")
from test_data_parallel import LoadingForever
from asynct.engine.core_client import CoreClient
from asynct.engine.engine_args import EngineArgs
client = CoreClient(EngineArgs(model=sys.argv[1]), make_engine=LoadingForever)
print(client.proc.pid, flush=True)
time.sleep(300)
"""


def test_an_engine_whose_front_end_was_killed_while_it_loads_exits(tiny_ckpt):
    """SIGKILL of the process holding an engine that is still loading: the engine loaded to the
    end (held its GPU memory minutes) before it could notice; it exits at once."""
    holder = subprocess.Popen([sys.executable, "-c", LOADING_HOLDER, str(tiny_ckpt)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    engine_pid = None
    try:
        engine_pid = int(holder.stdout.readline())
        time.sleep(1)                              # the engine is loading
        holder.kill()
        holder.communicate(timeout=30)            # till the engine, the pipes' last holder, is gone
    finally:
        holder.kill()
        if engine_pid is not None and holder.returncode is None:
            os.kill(engine_pid, signal.SIGKILL)


def test_server_sends_nothing_to_an_engine_whose_exit_it_has_not_read(tiny_ckpt):
    """An engine process gone, its exit message not yet handled on the event loop: a new request
    goes to the engine left (it was routed to the dead one and failed with a 500)."""
    from multiprocessing.connection import wait
    from asynct.entrypoints.serve.async_engine import AsyncEngine
    engine = AsyncEngine(EngineArgs(model=str(tiny_ckpt), data_parallel_size=2, **ENGINE))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def go():
        engine.start(asyncio.get_running_loop())
        first = engine.submit([[5, 6, 7]], greedy, stream=False)      # engine 0: engine 1 is next
        victim = engine.engines[1].client.proc
        os.kill(victim.pid, signal.SIGKILL)
        wait([victim.sentinel], timeout=10)
        second = engine.submit([[8, 9]], greedy, stream=False)       # the loop has not run since
        return [[out for latest in [u async for u in h.updates()] for out in latest.values()][-1]
                for h in (first, second)]
    try:
        outs = asyncio.run(go())
    finally:
        engine.stop()
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def metrics_by_engine(url) -> dict:
    import httpx
    text = httpx.get(url + "/metrics").text
    out = {}
    for name, labels, value in re.findall(r"^asynct_(\w+)\{([^}]*)\} (\S+)$", text, re.M):
        engine = re.search(r'engine="(\d+)"', labels)
        out[(name, engine.group(1) if engine else "total")] = float(value)
    return out


def test_server_two_engines_under_load(tiny_ckpt):
    """80 concurrent streams over two engines, a fifth hanging up early: every other stream gets
    exactly its text alone; both engines served; then every engine is idle with its blocks free.
    Then one engine is killed: only its request fails."""
    rng = random.Random(1)
    prompts = ["".join(rng.choice("abcdefghij klmnop,.XYZ0123é") for _ in range(rng.randint(3, 60)))
               for _ in range(10)]
    ref = LLM(tiny_ckpt)
    alone = [ref.generate([p], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
             .outputs[0].text for p in prompts]
    num, leaving = 80, set(rng.sample(range(80), 16))
    plan = [(i % len(prompts), rng.randint(1, 4) if i in leaving else None) for i in range(num)]
    app = make_app(tiny_ckpt, served_model_name="tiny", data_parallel_size=2, max_num_seqs=8, num_kv_blocks=200)
    with ServerThread(app) as url:
        texts = asyncio.run(run_load(url, prompts, plan))
        wrong = [i for i, ((p, leave), t) in enumerate(zip(plan, texts)) if leave is None and t != alone[p]]
        assert not wrong, [(texts[i], alone[plan[i][0]]) for i in wrong[:3]]
        total = wait_idle(url)
        m = metrics_by_engine(url)
        a_context_follows_its_engine(url)
        one_engine_killed(url, app.state.ctx.engine.engines[1].client.proc.pid)
    for k in ("0", "1", "total"):
        assert m[("num_requests_running", k)] == m[("num_requests_waiting", k)] == 0
        assert m[("num_requests_in_flight", k)] == 0
        assert m[("kv_blocks_free", k)] == m[("kv_blocks_total", k)] > 0
    assert m[("kv_blocks_total", "total")] == 400
    assert min(m[("generation_tokens_total", k)] for k in "01") > 0
    assert m[("requests_aborted_total", "total")] == total["requests_aborted_total"] == len(leaving)
    assert sum(m[("generation_tokens_total", k)] for k in "01") == m[("generation_tokens_total", "total")]


async def stream_lines(client, url, body, started):
    """A streamed completion's non-empty lines; `started` is set at the first."""
    lines = []
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            lines += [line] if line else []
            started.set()
    return lines


def a_context_follows_its_engine(url):
    """A question on a context that engine 0 is running goes to engine 0, though engine 1 is idle,
    and its context's full blocks come from the prefix cache (routed by load alone: none)."""
    import httpx
    context = "One long shared context for both questions: four blocks of sixteen bytes, and more. "
    body = {"model": "tiny", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    hits = metrics_by_engine(url)[("prefix_cache_hit_blocks_total", "total")]

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            started = asyncio.Event()
            first = asyncio.create_task(stream_lines(client, url, {**body, "prompt": context + "One?"}, started))
            await started.wait()
            r = await client.post(url + "/v1/completions", json={**body, "prompt": context + "Two?", "max_tokens": 2})
            await first
            return r

    assert asyncio.run(go()).status_code == 200
    wait_idle(url)
    assert metrics_by_engine(url)[("prefix_cache_hit_blocks_total", "total")] - hits >= len(context) // 16


def one_engine_killed(url, pid):
    """Two streams, one on each engine (both idle: the first goes to engine 0, the next to 1);
    engine 1 killed: its stream ends with an error naming it, the other finishes, /health says
    503, /metrics shows engine 1 running nothing and holding no blocks (its counters stay), and a
    new request is served by engine 0."""
    import httpx
    body = {"model": "tiny", "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}

    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event(), asyncio.Event()]
            first = asyncio.create_task(stream_lines(client, url, {**body, "prompt": "on engine 0"}, started[0]))
            await started[0].wait()
            second = asyncio.create_task(stream_lines(client, url, {**body, "prompt": "on engine 1"}, started[1]))
            await started[1].wait()
            os.kill(pid, signal.SIGKILL)
            return await first, await second

    survived, killed = asyncio.run(go())
    assert killed[-1] == "data: [DONE]" and "engine process 1 exited" in killed[-2]
    assert survived[-1] == "data: [DONE]" and '"finish_reason":"length"' in survived[-2].replace(" ", "")
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and "engine process 1 exited" in health.text
    m = metrics_by_engine(url)     # the dead engine's last snapshot showed its stream running
    assert m[("num_requests_running", "1")] == m[("num_requests_waiting", "1")] == 0
    assert m[("kv_blocks_total", "1")] == 0 and m[("kv_blocks_total", "total")] == m[("kv_blocks_total", "0")]
    assert m[("generation_tokens_total", "1")] > 0
    r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "prompt": "still here", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
