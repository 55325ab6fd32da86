#!/usr/bin/env bash
# The lead's end-to-end GPU session: one call, every benchmark, logs under $OUT.
# Usage (device tool): bash benchmarks/run_gpu.sh [stages...]
#   stages: smoke gputests sampling runtime first-latency startup issue13 issue13-rest order atomic mlp-atomic mlp-flags persistent fp8 vllm parity sweep decode-sweep decode-engine small-batch
#           mixed-host host-phases replay-cost splitk
#           bench engine profile profile-gsm8k prefill-profile
#           ablation cascade serve eval eval-mc loglikelihood dp
#   (dp: data-parallel scaling, N = 1, 2, ... as GPUs allow; needs the nvidia-h200-x2 kind or larger)
# A peer tree (`git archive <commit> asynct | tar -x -C peer`) runs from its own directory:
#   (cd peer && PYTHONPATH=$PWD/peer python3 -m asynct.entrypoints.cli bench ...)
# `python -m` and `python -c` put the working directory ahead of PYTHONPATH, and benchmarks that
# insert their checkout's root (serve_load.py, api_capacity.py, decode_streamk.py, ...) do the same:
# a peer named only in PYTHONPATH from this root runs this tree (`asynct bench` prints which ran).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# .whl (not in git): wheels of what the server needs and the device image lacks (fastapi, starlette,
# uvicorn, pydantic, pydantic_core, openai, jiter, annotated-types, typing-inspection, distro,
# sniffio, and opentelemetry-api, which fastapi 0.165 imports), made here with the device's Python
# (3.12) and carried (the run's `carry: [".whl"]`; without it the server's tests stop at import):
#   .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl $(.venv/bin/pip freeze | grep -i -E "^(fastapi|starlette|uvicorn|pydantic|pydantic.core|openai|jiter|annotated.types|typing.inspection|distro|sniffio|opentelemetry.api|h11|anyio|httpx|httpcore|importlib.metadata|zipp)==")
# and lm-eval's (the eval stages), the same way, with these names: lm.eval|datasets|dill|evaluate|
# more.itertools|pytablewriter|dataproperty|mbstrdecoder|pathvalidate|tabledata|tcolorpy|typepy|
# chardet|multiprocess|nltk|pytz; three have no wheel and are built here, pure Python:
#   .venv/bin/pip wheel --no-deps -w .whl $(.venv/bin/pip freeze | grep -i -E "^(sqlitedict|word2number|rouge.score)==")
# (19 MB in all; the device image has the rest of their dependencies)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
M=/tmp/bench-0.6b
[ -f $M/config.json ] || python3 -m asynct.entrypoints.cli make-checkpoint $M --preset bench-0.6b
stages=${*:-smoke bench profile ablation serve eval}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
for s in $stages; do
  echo "=== $s ($(date +%T))"
  case $s in
    smoke) timeout 300 python3 -m pytest tests/test_engine.py -x -q -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/smoke.log
           grep -q " passed" $OUT/smoke.log && ! grep -q "failed" $OUT/smoke.log || exit 1 ;;
    gputests) timeout 540 python3 -m pytest tests/test_gpu_runtime.py tests/test_piecewise_graphs.py \
             tests/test_async_scheduling.py tests/test_ops_attention.py tests/test_ops_elementwise.py \
             tests/test_fp8_kv.py tests/test_ops_fused_linear.py -q -p no:cacheprovider \
             2>&1 | tail -15 | tee $OUT/gputests.log ;;
    sampling) # the sampler's GPU paths (penalties, bad words, generation config): every LLM here
             # captures graphs, so these take minutes on a GPU; a call of their own
             timeout 540 python3 -m pytest tests/test_sampler.py tests/test_vllm_fields.py tests/test_generation_config.py \
             tests/test_llm_options.py -x -q -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/sampling.log ;;
    issue13) # issue 13's decode targets in one call (~6 min on a fresh machine): decode steps
             # against the roofline, decode attention chains, dense decode and prefill against SDPA;
             # `issue13-rest` (prefill plan sweep, bf16 parity) fits a second call
             timeout 200 python3 benchmarks/small_batch.py --model $M 2>&1 | grep -v "^{" | tee $OUT/small_batch.log
             timeout 100 python3 benchmarks/decode_chain.py now 2>&1 | tee $OUT/decode_chain.log
             timeout 120 python3 benchmarks/kernel_bench.py 2>&1 | tee $OUT/kernels.log ;;
    issue13-rest) timeout 200 python3 benchmarks/prefill_sweep.py 2>&1 | tee $OUT/sweep.log | tail -22
             timeout 200 python3 benchmarks/bf16_parity.py --seeds 1 --no-attribution 2>&1 | tee $OUT/parity.log ;;
    order) # decode rows longest first against batch order, over uneven contexts (100-2,048 keys):
             # the kernel alone, then whole decode steps
             timeout 120 python3 benchmarks/kernel_bench.py uneven 2>&1 | tee $OUT/uneven.log | tail -9
             timeout 300 python3 benchmarks/small_batch.py --model $M --skip-ops --modes "row order,fused" \
               --uneven 100,2048 --batches 64,96,128,192,256 2>&1 | grep -v "^{" | tee $OUT/order_steps.log ;;
    atomic) # small decode steps: the splits added into fp32 sums by atomics (QKV zeroes them, o_proj
             # reads them) against split partials + a sum kernel: whole steps, then 35-layer chains
             timeout 300 python3 benchmarks/small_batch.py --model $M --skip-ops --modes "no decode sums,fused" \
               --batches 1,2,3,4,8 2>&1 | grep -v "^{" | tee $OUT/sums_steps.log
             timeout 200 python3 benchmarks/decode_atomic.py 2>&1 | tee $OUT/atomic.log ;;
    mlp-atomic) # a dropped lead: batch 1's MLP as one kernel, down's K split over gate/up's programs (atomics)
             (cd benchmarks && PYTHONPATH=.. timeout 200 python3 mlp_atomic.py) 2>&1 | tee $OUT/mlp_atomic.log ;;
    mlp-flags) # a lead, untimed: batch 1's kernel boundary as a counter the producers add to, not a grid wait
             (cd benchmarks && PYTHONPATH=.. timeout 200 python3 mlp_flags.py) 2>&1 | tee $OUT/mlp_flags.log ;;
    first-latency) # a fresh machine's first process: empty Triton cache, cold imports
             timeout 300 python3 -m asynct.entrypoints.cli bench --model $M --no-warmup --breakdown \
               --workloads latency,throughput --gpu-memory-utilization 0.45 2>&1 | grep -v "^{" | tee $OUT/first.log ;;
    startup) # engine starts on empty then warm Triton caches, in-process and as the server's engine process
             C=$(mktemp -d); S=$(mktemp -d)
             for c in $C $C; do TRITON_CACHE_DIR=$c timeout 200 python3 benchmarks/startup_phases.py $M 2>&1 | tee -a $OUT/startup.log; done
             for c in $S $S; do TRITON_CACHE_DIR=$c timeout 200 python3 benchmarks/startup_phases.py $M --server 2>&1 | tee -a $OUT/startup.log; done ;;
    persistent) # the batch-1 prototype: every layer's MLP in one persistent CUDA kernel (grid barriers)
             # against the engine's fused Triton pair; a hang (a barrier that never opens) ends at the timeout
             timeout 150 python3 benchmarks/persistent_mlp.py 2>&1 | tee $OUT/persistent.log ;;
    mixed-host) # a mixed step's host launch: device busy vs idle, synchronising ops, cProfile
           (cd benchmarks && timeout 120 python3 mixed_host.py --model $M 2>&1 | grep -v "it/s" | tee $OUT/mixed_host.log) ;;
    host-phases) # the host's phases of a ~220-row decode step with lm-eval's gsm8k stop strings (and
             # without), this tree then PEER's (a `git archive <commit> asynct` directory), alternating
             T=/tmp/bench-0.6b-tok
             [ -f $T/config.json ] || python3 -c "from asynct.model.checkpoint import make_checkpoint as m; m('bench-0.6b', '$T', tokenizer=True)"
             for tree in $PWD ${PEER:-} $PWD ${PEER:-}; do
               for stop in "" --no-stop; do
                 echo "$tree $stop" | tee -a $OUT/host_phases.log
                 PYTHONPATH=$tree timeout 120 python3 benchmarks/host_phases.py --model $T $stop 2>&1 | tail -4 | tee -a $OUT/host_phases.log
               done
             done ;;
    replay-cost) # a decode graph's replay() host time by batch size, and whether it frees the GIL
             timeout 120 python3 benchmarks/graph_replay_cost.py $M 2>&1 | grep -v Warn | tee $OUT/replay_cost.log ;;
    splitk) # a lead: 65-1,024-row projections split over K by cuBLAS's batched GEMM
           timeout 200 python3 benchmarks/splitk_linear.py 2>&1 | tee $OUT/splitk.log | grep "^|" ;;
    fp8) timeout 300 python3 benchmarks/fp8_kv.py $M 2>&1 | grep -v "^{" | tee $OUT/fp8.log ;;
    vllm) timeout 120 python3 benchmarks/vllm_backend_gpu.py 2>&1 | tee $OUT/vllm.log ;;
    parity) timeout 300 python3 benchmarks/bf16_parity.py --seeds 1 2>&1 | tee $OUT/parity.log ;;
    sweep) timeout 170 python3 benchmarks/prefill_sweep.py 2>&1 | tee $OUT/sweep.log ;;
    decode-sweep) timeout 120 python3 benchmarks/decode_sweep.py 2>&1 | tee $OUT/decode_sweep.log ;;
    decode-engine) # the engine's decode config on the sweep's shapes, plain and as the graphs' cascade variant
             timeout 120 python3 benchmarks/decode_sweep.py --engine 2>&1 | tee $OUT/decode_engine.log ;;
    small-batch) timeout 300 python3 benchmarks/small_batch.py --model $M --sweep 2>&1 | grep -v "^{" \
             | tee $OUT/small_batch.log ;;
    runtime) # a new user's first run (empty Triton cache, cold process), then the same workloads warm;
             # then a second process (warm cache) without piecewise graphs for the same-run ratio
             for flags in "" "--cudagraph-mode full_decode_only"; do
               timeout 240 python3 -m asynct.entrypoints.cli bench --model $M --no-warmup --breakdown $flags \
                 --workloads gsm8k,gsm8k,throughput,latency,prefill --gpu-memory-utilization 0.45 2>&1 | grep -v "^{" \
                 | tee -a $OUT/runtime.log
             done ;;
    bench) timeout 240 python3 -m asynct.entrypoints.cli bench --model $M --compare hf --gpu-memory-utilization 0.45 \
             --plot $OUT/bench.png --json-out $OUT/bench.json 2>&1 | grep -v "^{" | tee $OUT/bench.log ;;
    engine) timeout 200 python3 -m asynct.entrypoints.cli bench --model $M --json-out $OUT/engine.json 2>&1 \
             | grep -v "^{" | tee $OUT/engine.log ;;
    profile) timeout 150 python3 benchmarks/profile_decode.py --model $M 2>&1 | tee $OUT/profile.log ;;
    prefill-profile) # an evaluation's scoring pass: kernels by name, the GPU's idle gaps
             timeout 150 python3 benchmarks/prefill_profile.py $M 2>&1 | grep -v "^{" | tee $OUT/prefill_profile.log ;;
    profile-gsm8k) # the gsm8k-shaped decode step: ~220 sequences of ~930 keys, 700 of them shared
             timeout 150 python3 benchmarks/profile_decode.py --model $M --batch 224 --context 928 \
               --shared-prefix 700 --steps 30 2>&1 | tee $OUT/profile_gsm8k.log ;;
    ablation) timeout 240 python3 benchmarks/seed_ablation.py --model $M 2>&1 | tee $OUT/ablation.log ;;
    cascade) timeout 240 python3 benchmarks/cascade_ablation.py --model $M 2>&1 | grep -v "Loading weights" | tee $OUT/cascade.log ;;
    serve) [ -f benchmarks/serve_load.py ] && timeout 150 python3 benchmarks/serve_load.py --model $M 2>&1 | tee $OUT/serve.log ;;
    dp) timeout 400 python3 benchmarks/dp_bench.py --model $M --json-out $OUT/dp.json 2>&1 | tee $OUT/dp.log
        for n in 1 2; do
          timeout 300 python3 benchmarks/eval_bench.py --skip-hf --asynct-args "--model_args data_parallel_size=$n" \
            2>&1 | tee $OUT/eval_dp$n.log
        done ;;
    eval) [ -f benchmarks/eval_bench.py ] && timeout 300 python3 benchmarks/eval_bench.py --hf-limit 256 2>&1 | tee $OUT/eval.log ;;
    eval-mc) timeout 300 python3 benchmarks/eval_bench.py --task tiny_gsm_mc 2>&1 | tee $OUT/eval_mc.log ;;
    loglikelihood) # lm-eval's scoring requests through AsyncTLM (MC and rolling; lm-eval from .whl)
             [ -f $M-tok/config.json ] || python3 -c "from asynct.model.checkpoint import make_checkpoint; make_checkpoint('bench-0.6b', '$M-tok', tokenizer=True)"
             timeout 200 python3 benchmarks/loglikelihood_bench.py --model $M-tok 2>&1 | tee $OUT/loglikelihood.log ;;
  esac
done
