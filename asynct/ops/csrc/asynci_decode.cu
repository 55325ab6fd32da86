// Paged AsyncI decode, CUDA. One CTA per (split, KV head, sequence); the G query heads of the
// KV group share every K/V load. Each lane owns 16 bytes of a key row; a key's score is a
// warp-shuffle reduction over the lanes of its row. Scores go to shared memory, where the
// causal pool reads its left neighbours directly (the previous chunk's tail stays in the other
// half of a ping-pong buffer, so no copy). Plain C++/CUDA: no torch headers, so that nvcc
// alone can build and check it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "asynci_decode.h"

namespace asynct {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ void to_float8(const uint4& u, float* f, __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

__device__ __forceinline__ void to_float8(const uint4& u, float* f, __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads) asynci_decode_kernel(DecodeArgs args) {
  constexpr int kLanesPerRow = D / 8;            // 16 bytes per lane
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  constexpr int kRowsPerStep = kWarps * kRowsPerWarp;
  constexpr int kSteps = kChunk / kRowsPerStep;
  __shared__ float s_buf[2][G][kChunk];  // scores, ping-pong by chunk parity
  __shared__ float a_buf[G][kChunk];     // gates
  __shared__ float red[kWarps][G][D];

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, nsplit = gridDim.x;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int col = (lane % kLanesPerRow) * 8, sub = lane / kLanesPerRow;
  const int n_keys = args.seq_lens[b];
  // split ranges from the device-side length: graph-safe and right for any length
  const int per = ((n_keys + nsplit - 1) / nsplit + kChunk - 1) / kChunk * kChunk;
  const int lo = split * per, hi = min(lo + per, n_keys);
  const int* bt = args.block_table + b * args.sbt;
  const T* kc = static_cast<const T*>(args.k_cache);
  const T* vc = static_cast<const T*>(args.v_cache);
  const int bs = args.block_size;
  const int64_t head_off = (int64_t)kvh * D + col;
  auto row = [&](int key) -> int64_t {
    return ((int64_t)bt[key / bs] * bs + key % bs) * args.hkv * D + head_off;
  };

  float qf[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = static_cast<const T*>(args.q) + b * args.sqb + (kvh * G + g) * args.sqh + col;
    to_float8(*reinterpret_cast<const uint4*>(qp), qf[g], T());
#pragma unroll
    for (int i = 0; i < 8; ++i) qf[g][i] *= args.scale;
  }
  auto score = [&](const uint4& kv, int g, float* kf) {
    float d = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) d = fmaf(qf[g][i], kf[i], d);
#pragma unroll
    for (int off = kLanesPerRow / 2; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
    return d;
  };

  // halo: scores of the pool-1 keys left of lo go to the tail of s_buf[1] (zero before key 0)
  for (int i = tid; i < G * kChunk; i += kThreads) s_buf[1][i / kChunk][i % kChunk] = 0.f;
  __syncthreads();
  for (int r0 = 0; r0 < args.pool - 1 && lo < hi; r0 += kRowsPerStep) {
    const int r = r0 + warp * kRowsPerWarp + sub, key = lo - 1 - r;
    const bool ok = r < args.pool - 1 && key >= 0;
    uint4 kv = ok ? *reinterpret_cast<const uint4*>(kc + row(key)) : make_uint4(0, 0, 0, 0);
    float kf[8];
    to_float8(kv, kf, T());
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float s = score(kv, g, kf);
      if (ok && lane % kLanesPerRow == 0) s_buf[1][g][kChunk - 1 - r] = s;
    }
  }
  __syncthreads();

  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;

  int par = 0;
  for (int c0 = lo; c0 < hi; c0 += kChunk, par ^= 1) {
    uint4 kv[kSteps], vv[kSteps];
#pragma unroll
    for (int it = 0; it < kSteps; ++it) {  // all loads of the chunk in flight at once
      const int key = c0 + it * kRowsPerStep + warp * kRowsPerWarp + sub;
      kv[it] = vv[it] = make_uint4(0, 0, 0, 0);
      if (key < hi) {
        const int64_t off = row(key);
        kv[it] = *reinterpret_cast<const uint4*>(kc + off);
        vv[it] = *reinterpret_cast<const uint4*>(vc + off);
      }
    }
#pragma unroll
    for (int it = 0; it < kSteps; ++it) {
      const int kl = it * kRowsPerStep + warp * kRowsPerWarp + sub;
      float kf[8];
      to_float8(kv[it], kf, T());
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float s = score(kv[it], g, kf);
        if (lane % kLanesPerRow == 0) s_buf[par][g][kl] = s;
      }
    }
    __syncthreads();
    for (int i = tid; i < G * kChunk; i += kThreads) {
      const int g = i / kChunk, kl = i % kChunk;
      float sum = 0.f;
      for (int m = 0; m < args.pool; ++m) {
        const int j = kl - m;
        const float x = j >= 0 ? s_buf[par][g][j] : s_buf[par ^ 1][g][kChunk + j];
        sum += args.relu ? fmaxf(x, 0.f) : x;
      }
      const float s = s_buf[par][g][kl], sg = args.sigma[kvh * G + g];
      const float a = fminf(fmaxf(s - sg * (sum / args.pool), 0.f), 1.f);
      a_buf[g][kl] = c0 + kl < hi ? a : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kSteps; ++it) {
      const int kl = it * kRowsPerStep + warp * kRowsPerWarp + sub;
      float vf[8];
      to_float8(vv[it], vf, T());
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float a = a_buf[g][kl];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(a, vf[i], acc[g][i]);
      }
    }
  }

  // sum the rows a warp's lanes hold, then the warps
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float x = acc[g][i];
#pragma unroll
      for (int off = kLanesPerRow; off < 32; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
      if (sub == 0) red[warp][g][col + i] = x;
    }
  __syncthreads();
  const int hq = args.hkv * G;
  for (int i = tid; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D, h = kvh * G + g;
    float x = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) x += red[w][g][d];
    if (args.partial != nullptr)
      args.partial[(((int64_t)b * hq + h) * nsplit + split) * D + d] = x;
    else
      store(static_cast<T*>(args.out) + b * args.sob + h * args.soh + d, x);
  }
}

template <typename T, int D>
__global__ void sum_splits_kernel(DecodeArgs args, int hq, int nsplit) {
  const int h = blockIdx.x, b = blockIdx.y;
  const float* p = args.partial + ((int64_t)b * hq + h) * nsplit * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float x = 0.f;
    for (int s = 0; s < nsplit; ++s) x += p[s * D + d];
    store(static_cast<T*>(args.out) + b * args.sob + h * args.soh + d, x);
  }
}

template <typename T, int D, int G>
cudaError_t launch(const DecodeArgs& args, int batch, int splits, cudaStream_t stream) {
  dim3 grid(splits, args.hkv, batch);
  asynci_decode_kernel<T, D, G><<<grid, kThreads, 0, stream>>>(args);
  if (splits > 1)
    sum_splits_kernel<T, D><<<dim3(args.hkv * G, batch), D, 0, stream>>>(args, args.hkv * G, splits);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_g(const DecodeArgs& args, int g, int batch, int splits, cudaStream_t stream) {
  switch (g) {
    case 1: return launch<T, D, 1>(args, batch, splits, stream);
    case 2: return launch<T, D, 2>(args, batch, splits, stream);
    case 4: return launch<T, D, 4>(args, batch, splits, stream);
    case 8: return launch<T, D, 8>(args, batch, splits, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_d(const DecodeArgs& args, int d, int g, int batch, int splits, cudaStream_t s) {
  switch (d) {
    case 64: return launch_g<T, 64>(args, g, batch, splits, s);
    case 128: return launch_g<T, 128>(args, g, batch, splits, s);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t asynci_decode_launch(const DecodeArgs& args, bool bf16, int head_dim, int group,
                                 int batch, int splits, cudaStream_t stream) {
  if (args.pool < 1 || args.pool > kChunk) return cudaErrorInvalidValue;
  return bf16 ? launch_d<__nv_bfloat16>(args, head_dim, group, batch, splits, stream)
              : launch_d<__half>(args, head_dim, group, batch, splits, stream);
}

}  // namespace asynct
