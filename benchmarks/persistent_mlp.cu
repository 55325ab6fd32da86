// A prototype for issue 13's batch-1 target, built and driven by persistent_mlp.py: the MLP of
// every layer (gate/up + ReGLU, then down + residual add + the next DyHT) at ONE token, in one
// persistent kernel whose phases meet at software grid barriers instead of kernel boundaries.
// The question it answers: does a barrier cost less than a programmatic-dependent-launch
// boundary (~2.5 us on the H200) once each warp has the next phase's weights in flight before
// it waits? Weights do not depend on the barrier, so their loads are issued first.
//
// One block per SM (a cooperative launch guarantees they are all resident), 8 warps (or 16); a
// warp owns whole weight rows and reduces them with shuffles. bf16 weights and activations, fp32
// sums rounded to bf16 as asynct's fused kernels round their accumulators, then act =
// bf16(relu(g) * u), hidden = bf16(residual + acc), normed = bf16(w * clamp(a * hidden, -1, 1)).
// Plain CUDA, no torch headers: nvcc alone builds it into a shared library (ctypes calls it).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kH = 1024;          // hidden
constexpr int kI = 3072;          // intermediate
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kChunksH = kH / 256;  // a lane's 16-byte pieces of a hidden-wide row
constexpr int kChunksI = kI / 256;  // ... of an intermediate-wide row

struct Args {
  const __nv_bfloat16* w_gu;  // [L, 2I, H]: gate rows, then up rows
  const __nv_bfloat16* w_d;   // [L, H, I]
  const float* alpha;         // [L, H] the DyHT after each layer's residual add
  const float* dyw;           // [L, H]
  __nv_bfloat16* m;           // [H] the normed input of the MLP, then of the next layer
  __nv_bfloat16* residual;    // [H]
  __nv_bfloat16* act;         // [I]
  unsigned int* bar;          // [2]: arrivals, generation (zeroed once, before the first launch)
  int first, last;            // layers [first, last)
  int work;                   // the TMA kernel's attribution: +1 stage the inputs, +2 compute (3: all)
};

__device__ __forceinline__ uint4 ld_stream(const __nv_bfloat16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 8 products of a weight piece and the matching activation piece (bf16 in shared memory: one
// 16-byte read a lane, adjacent lanes adjacent, no bank conflict), fp32 sums.
__device__ __forceinline__ float dot8(const uint4& w, const __nv_bfloat16* x) {
  const uint4 xv = *reinterpret_cast<const uint4*>(x);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&xv);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]), g = __bfloat1622float2(v[i]);
    s = fmaf(f.x, g.x, s);
    s = fmaf(f.y, g.y, s);
  }
  return s;
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Sense-reversing grid barrier, as cooperative groups' grid.sync(): the block's writes are
// ordered before its arrival by the CTA barrier and the device-scope fence.
__device__ __forceinline__ void grid_barrier(unsigned int* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned int* gen = bar + 1;
    const unsigned int g = *gen;   // this block has not arrived: the generation cannot move yet
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      bar[0] = 0;
      __threadfence();
      atomicExch(bar + 1, g + 1);
    } else {
      while (*gen == g) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

struct SenseBarrier {   // the barrier above, as a type the kernels take
  unsigned int* bar;
  __device__ __forceinline__ void init(unsigned int* b) { bar = b; }
  __device__ __forceinline__ void sync() { grid_barrier(bar); }
};

__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void arrive(unsigned long long* p) {
  __threadfence();
  asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(p) : "memory");
}

// Arrival counters that only grow (64 bits: they never wrap), so nobody resets them and nobody
// waits for a last arriver's second write: a block adds 1 (fire and forget) and polls until the
// counters reach this barrier's target. kSpread counters in their own 128-byte lines, block b
// arriving at b % kSpread, spread the same-address atomics over L2 slices; lane i of warp 0
// polls counter i. A launch finds its base from the counter: no block can pass the first
// barrier before this one arrives, so at most count - 1 arrivals are past a multiple of count.
template <int kSpread>
struct CountBarrier {
  unsigned long long* cnt;   // counter i at cnt[16 * i]
  unsigned long long target;
  int count;                 // blocks arriving at this lane's counter
  __device__ __forceinline__ void init(unsigned int* b) {
    cnt = reinterpret_cast<unsigned long long*>(b + 64);
    count = threadIdx.x < kSpread ? (gridDim.x + kSpread - 1 - threadIdx.x) / kSpread : 0;
    if (count) {
      const unsigned long long v = ld_acquire(cnt + 16 * threadIdx.x);
      target = v - v % count;
    }
  }
  __device__ __forceinline__ void sync() {
    __syncthreads();
    if (threadIdx.x == 0) arrive(cnt + 16 * (blockIdx.x % kSpread));
    if (count) {
      target += count;
      while (ld_acquire(cnt + 16 * threadIdx.x) < target) {
      }
    }
    __syncthreads();
  }
};

// n bf16 (written by other blocks before the barrier) into shared memory, by the whole block;
// __ldcg reads L2, where those writes are, never a stale line of this SM's L1.
template <int kT = kThreads>
__device__ __forceinline__ void stage(const __nv_bfloat16* src, __nv_bfloat16* dst, int n) {
  for (int i = threadIdx.x * 8; i < n; i += kT * 8)
    *reinterpret_cast<uint4*>(dst + i) = __ldcg(reinterpret_cast<const uint4*>(src + i));
  __syncthreads();
}

struct GateUp {
  uint4 g[kChunksH], u[kChunksH];
};

__device__ __forceinline__ void load_gate_up(const __nv_bfloat16* w, int j, int lane, GateUp& r) {
#pragma unroll
  for (int c = 0; c < kChunksH; ++c) {
    r.g[c] = ld_stream(w + (int64_t)j * kH + c * 256 + lane * 8);
    r.u[c] = ld_stream(w + (int64_t)(kI + j) * kH + c * 256 + lane * 8);
  }
}

__device__ __forceinline__ void finish_gate_up(const GateUp& r, const __nv_bfloat16* xs, int j, int lane,
                                               __nv_bfloat16* act) {
  float g = 0.f, u = 0.f;
#pragma unroll
  for (int c = 0; c < kChunksH; ++c) {
    g += dot8(r.g[c], xs + c * 256 + lane * 8);
    u += dot8(r.u[c], xs + c * 256 + lane * 8);
  }
  g = round_bf16(warp_sum(g));
  u = round_bf16(warp_sum(u));
  if (lane == 0) act[j] = __float2bfloat16_rn(fmaxf(g, 0.f) * u);
}

struct Down {
  uint4 w[kChunksI];
};

__device__ __forceinline__ void load_down(const __nv_bfloat16* w, int n, int lane, Down& r) {
#pragma unroll
  for (int c = 0; c < kChunksI; ++c) r.w[c] = ld_stream(w + (int64_t)n * kI + c * 256 + lane * 8);
}

template <class Barrier>
__global__ void __launch_bounds__(kThreads, 1) persistent_mlp_kernel(Args a) {
  Barrier barrier;
  barrier.init(a.bar);
  __shared__ __align__(16) __nv_bfloat16 xs[kI];  // the phase's input vector (m: kH, act: kI)
  const int lane = threadIdx.x % 32;
  const int gw = blockIdx.x * kWarps + threadIdx.x / 32, nw = gridDim.x * kWarps;
  GateUp first;
  if (gw < kI) load_gate_up(a.w_gu + (int64_t)a.first * 2 * kI * kH, gw, lane, first);
  for (int l = a.first; l < a.last; ++l) {
    const __nv_bfloat16* w_gu = a.w_gu + (int64_t)l * 2 * kI * kH;
    const __nv_bfloat16* w_d = a.w_d + (int64_t)l * kH * kI;
    // phase 1: gate/up + ReGLU; this warp's first rows are already in flight
    stage(a.m, xs, kH);
    if (gw < kI) finish_gate_up(first, xs, gw, lane, a.act);
    for (int j = gw + nw; j < kI; j += 2 * nw) {  // two rows' loads in flight at once
      GateUp r0, r1;
      load_gate_up(w_gu, j, lane, r0);
      const bool two = j + nw < kI;
      if (two) load_gate_up(w_gu, j + nw, lane, r1);
      finish_gate_up(r0, xs, j, lane, a.act);
      if (two) finish_gate_up(r1, xs, j + nw, lane, a.act);
    }
    Down d;  // issued before the barrier: the weights do not wait for the activations
    if (gw < kH) load_down(w_d, gw, lane, d);
    barrier.sync();
    // phase 2: down + residual + the next DyHT, one weight row a warp
    stage(a.act, xs, kI);
    for (int n = gw; n < kH; n += nw) {
      if (n != gw) load_down(w_d, n, lane, d);
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < kChunksI; ++c) s += dot8(d.w[c], xs + c * 256 + lane * 8);
      s = round_bf16(warp_sum(s));
      if (lane == 0) {
        const float h = round_bf16(s + __bfloat162float(a.residual[n]));
        a.residual[n] = __float2bfloat16_rn(h);
        const float x = fminf(fmaxf(a.alpha[(int64_t)l * kH + n] * h, -1.f), 1.f);
        a.m[n] = __float2bfloat16_rn(a.dyw[(int64_t)l * kH + n] * x);
      }
    }
    if (l + 1 < a.last && gw < kI) load_gate_up(w_gu + 2 * kI * kH, gw, lane, first);
    barrier.sync();
  }
}


// ---- variant 2: weights streamed into shared memory by the TMA engine -----------------------
// Variant 1 keeps each warp's next rows in registers: ~8 KB a warp in flight, and each phase
// still pays a round trip after its barrier. Here a block owns a fixed slice of every phase's
// rows (gate/up: 23-24 row pairs, 96 KB; down: 7-8 rows, 48 KB) and one thread asks the TMA
// unit for the slice of the NEXT use of each buffer as soon as this use has read it: gate/up of
// layer l+1 streams during down of layer l and its barrier, and the reverse, so HBM always has
// a whole phase's weights requested. An mbarrier a buffer says when its bytes have landed.

constexpr int kPairsMax = 24;   // ceil(3072 / 132)
constexpr int kRowsMax = 8;     // ceil(1024 / 132)
constexpr int kSmemGate = kPairsMax * kH;   // bf16 elements: gate rows, then up rows as many
constexpr int kSmemDown = kRowsMax * kI;
constexpr size_t kSmemBytes = (2 * kSmemGate + kSmemDown + kI) * 2 + 2 * sizeof(uint64_t);

__device__ __forceinline__ uint32_t smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
}

// bytes (a multiple of 16, both ends 16-byte aligned) from global to this block's shared memory
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem(dst)), "l"(src), "r"(bytes), "r"(smem(bar)) : "memory");
}

struct Slice {
  int begin, end;
};

__device__ __forceinline__ Slice block_slice(int n) {
  return {static_cast<int>((int64_t)blockIdx.x * n / gridDim.x), static_cast<int>((int64_t)(blockIdx.x + 1) * n / gridDim.x)};
}

// One thread: the slice's rows of one layer into a buffer; the generic-proxy reads of the
// buffer's last use (ordered before by the caller's __syncthreads) must precede the TMA's writes.
// kPerRow: one copy a weight row (2-6 KB) instead of one a slice (up to 48 KB)
template <bool kPerRow>
__device__ __forceinline__ void fetch_rows(__nv_bfloat16* dst, const __nv_bfloat16* src, int rows, int len, uint64_t* bar) {
  if constexpr (kPerRow) {
    for (int r = 0; r < rows; ++r) bulk_load(dst + r * len, src + (int64_t)r * len, len * 2, bar);
  } else {
    bulk_load(dst, src, rows * len * 2, bar);
  }
}

template <bool kPerRow>
__device__ __forceinline__ void fetch_gate_up(const __nv_bfloat16* w_gu, Slice p, __nv_bfloat16* buf, uint64_t* bar) {
  const int rows = p.end - p.begin;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect(bar, 2 * rows * kH * 2);
  fetch_rows<kPerRow>(buf, w_gu + (int64_t)p.begin * kH, rows, kH, bar);
  fetch_rows<kPerRow>(buf + kSmemGate, w_gu + (int64_t)(kI + p.begin) * kH, rows, kH, bar);
}

template <bool kPerRow>
__device__ __forceinline__ void fetch_down(const __nv_bfloat16* w_d, Slice r, __nv_bfloat16* buf, uint64_t* bar) {
  const int rows = r.end - r.begin;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect(bar, rows * kI * 2);
  fetch_rows<kPerRow>(buf, w_d + (int64_t)r.begin * kI, rows, kI, bar);
}

// a weight row in shared memory against xs, by one warp: fp32 sum of all lanes
template <int kLen>
__device__ __forceinline__ float row_dot(const __nv_bfloat16* w, const __nv_bfloat16* xs, int lane) {
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < kLen / 256; ++c) {
    const uint4 wv = *reinterpret_cast<const uint4*>(w + c * 256 + lane * 8);
    s += dot8(wv, xs + c * 256 + lane * 8);
  }
  return warp_sum(s);
}

template <class Barrier, int kW = kWarps, bool kPerRow = false>
__global__ void __launch_bounds__(kW * 32, 1) persistent_mlp_tma_kernel(Args a) {
  Barrier barrier;
  barrier.init(a.bar);
  extern __shared__ __align__(128) unsigned char raw[];
  __nv_bfloat16* gate_up = reinterpret_cast<__nv_bfloat16*>(raw);
  __nv_bfloat16* down = gate_up + 2 * kSmemGate;
  __nv_bfloat16* xs = down + kSmemDown;
  uint64_t* bars = reinterpret_cast<uint64_t*>(xs + kI);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Slice pairs = block_slice(kI), rows = block_slice(kH);
  if (threadIdx.x == 0) {
    mbar_init(&bars[0]);
    mbar_init(&bars[1]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fetch_gate_up<kPerRow>(a.w_gu + (int64_t)a.first * 2 * kI * kH, pairs, gate_up, &bars[0]);
    fetch_down<kPerRow>(a.w_d + (int64_t)a.first * kH * kI, rows, down, &bars[1]);
  }
  __syncthreads();
  for (int l = a.first; l < a.last; ++l) {
    const uint32_t parity = (l - a.first) & 1;
    if (a.work & 1) stage<kW * 32>(a.m, xs, kH);
    mbar_wait(&bars[0], parity);
    for (int j = pairs.begin + warp; j < pairs.end && (a.work & 2); j += kW) {
      const int k = j - pairs.begin;
      const float g = round_bf16(row_dot<kH>(gate_up + k * kH, xs, lane));
      const float u = round_bf16(row_dot<kH>(gate_up + kSmemGate + k * kH, xs, lane));
      if (lane == 0) a.act[j] = __float2bfloat16_rn(fmaxf(g, 0.f) * u);
    }
    __syncthreads();
    if (threadIdx.x == 0 && l + 1 < a.last)
      fetch_gate_up<kPerRow>(a.w_gu + (int64_t)(l + 1) * 2 * kI * kH, pairs, gate_up, &bars[0]);
    barrier.sync();
    if (a.work & 1) stage<kW * 32>(a.act, xs, kI);
    mbar_wait(&bars[1], parity);
    for (int n = rows.begin + warp; n < rows.end && (a.work & 2); n += kW) {
      const float s = round_bf16(row_dot<kI>(down + (n - rows.begin) * kI, xs, lane));
      if (lane == 0) {
        const float h = round_bf16(s + __bfloat162float(a.residual[n]));
        a.residual[n] = __float2bfloat16_rn(h);
        const float x = fminf(fmaxf(a.alpha[(int64_t)l * kH + n] * h, -1.f), 1.f);
        a.m[n] = __float2bfloat16_rn(a.dyw[(int64_t)l * kH + n] * x);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0 && l + 1 < a.last)
      fetch_down<kPerRow>(a.w_d + (int64_t)(l + 1) * kH * kI, rows, down, &bars[1]);
    barrier.sync();
  }
}

// variant 2: the two grid barriers a layer alone, no work: what the barriers cost
template <class Barrier>
__global__ void __launch_bounds__(kThreads, 1) barriers_only_kernel(Args a) {
  Barrier barrier;
  barrier.init(a.bar);
  for (int l = a.first; l < a.last; ++l) {
    barrier.sync();
    barrier.sync();
  }
}

}  // namespace

// variant = 3 * kernel + barrier. kernel 0: weights through registers; 1: through shared
// memory (TMA), 8 warps; 2: the barriers alone (computes nothing); 3: TMA, 16 warps; 4: TMA, 16
// warps, one copy a weight row. barrier 0: sense-reversing; 1: one growing counter; 2: eight.
struct Launch {
  const void* kernel;
  int threads;
  size_t smem_bytes;
};

template <class B>
static void launches_of(Launch* l) {
  l[0] = {reinterpret_cast<const void*>(persistent_mlp_kernel<B>), kThreads, 0};
  l[3] = {reinterpret_cast<const void*>(persistent_mlp_tma_kernel<B>), kThreads, kSmemBytes};
  l[6] = {reinterpret_cast<const void*>(barriers_only_kernel<B>), kThreads, 0};
  l[9] = {reinterpret_cast<const void*>(persistent_mlp_tma_kernel<B, 16>), 512, kSmemBytes};
  l[12] = {reinterpret_cast<const void*>(persistent_mlp_tma_kernel<B, 16, true>), 512, kSmemBytes};
}

static Launch launch_of(int variant) {
  Launch l[15];
  launches_of<SenseBarrier>(l);
  launches_of<CountBarrier<1>>(l + 1);
  launches_of<CountBarrier<8>>(l + 2);
  return l[variant];
}

// The grid: one block per SM; 0 where one block cannot fit an SM; -cudaError on a failed query.
extern "C" int persistent_mlp_blocks(int variant) {
  const Launch l = launch_of(variant);
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess && l.smem_bytes)
    e = cudaFuncSetAttribute(l.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(l.smem_bytes));
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, l.kernel, l.threads, l.smem_bytes);
  if (e != cudaSuccess) return -static_cast<int>(e);
  return per_sm >= 1 ? sms : 0;
}

// Returns a cudaError_t (0: launched). `cooperative`: the cooperative launch, which refuses a
// grid that cannot be resident at once; 0: a plain launch (graph capture), same grid, which
// relies on the GPU being this process's alone (under MPS, MIG or another process's kernels a
// block may never start, and the barrier never opens). persistent_mlp_blocks(variant) first.
extern "C" int persistent_mlp(const void* w_gu, const void* w_d, const float* alpha, const float* dyw,
                              void* m, void* residual, void* act, unsigned int* bar, int first, int last,
                              int blocks, int cooperative, int variant, int work, cudaStream_t stream) {
  Args a{static_cast<const __nv_bfloat16*>(w_gu), static_cast<const __nv_bfloat16*>(w_d), alpha, dyw,
         static_cast<__nv_bfloat16*>(m), static_cast<__nv_bfloat16*>(residual),
         static_cast<__nv_bfloat16*>(act), bar, first, last, work};
  const Launch l = launch_of(variant);
  void* params[] = {&a};
  if (cooperative)
    return cudaLaunchCooperativeKernel(l.kernel, dim3(blocks), dim3(l.threads), params, l.smem_bytes, stream);
  return cudaLaunchKernel(l.kernel, dim3(blocks), dim3(l.threads), params, l.smem_bytes, stream);
}
