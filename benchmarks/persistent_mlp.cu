// A prototype for issue 13's batch-1 target, built and driven by persistent_mlp.py: the MLP of
// every layer (gate/up + ReGLU, then down + residual add + the next DyHT) at ONE token, in one
// persistent kernel whose phases meet at software grid barriers instead of kernel boundaries.
// The question it answers: does a barrier cost less than a programmatic-dependent-launch
// boundary (~2.5 us on the H200) once each warp has the next phase's weights in flight before
// it waits? Weights do not depend on the barrier, so their loads are issued first.
//
// One block per SM (a cooperative launch guarantees they are all resident), 8 warps; a warp
// owns whole weight rows and reduces them with shuffles. bf16 weights and activations, fp32
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

// n bf16 (written by other blocks before the barrier) into shared memory, by the whole block;
// __ldcg reads L2, where those writes are, never a stale line of this SM's L1.
__device__ __forceinline__ void stage(const __nv_bfloat16* src, __nv_bfloat16* dst, int n) {
  for (int i = threadIdx.x * 8; i < n; i += kThreads * 8)
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

__global__ void __launch_bounds__(kThreads, 1) persistent_mlp_kernel(Args a) {
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
    grid_barrier(a.bar);
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
    grid_barrier(a.bar);
  }
}

}  // namespace

// The grid: one block per SM; 0 where one block cannot fit an SM; -cudaError on a failed query.
extern "C" int persistent_mlp_blocks() {
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_mlp_kernel, kThreads, 0);
  if (e != cudaSuccess) return -static_cast<int>(e);
  return per_sm >= 1 ? sms : 0;
}

// Returns a cudaError_t (0: launched). `cooperative`: the cooperative launch, which refuses a
// grid that cannot be resident at once; 0: a plain launch (graph capture), same grid, which
// relies on the GPU being this process's alone (under MPS, MIG or another process's kernels a
// block may never start, and the barrier never opens).
extern "C" int persistent_mlp(const void* w_gu, const void* w_d, const float* alpha, const float* dyw,
                              void* m, void* residual, void* act, unsigned int* bar, int first, int last,
                              int blocks, int cooperative, cudaStream_t stream) {
  Args a{static_cast<const __nv_bfloat16*>(w_gu), static_cast<const __nv_bfloat16*>(w_d), alpha, dyw,
         static_cast<__nv_bfloat16*>(m), static_cast<__nv_bfloat16*>(residual),
         static_cast<__nv_bfloat16*>(act), bar, first, last};
  if (cooperative) {
    void* params[] = {&a};
    return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_mlp_kernel), dim3(blocks),
                                       dim3(kThreads), params, 0, stream);
  }
  persistent_mlp_kernel<<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}
