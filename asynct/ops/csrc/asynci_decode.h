// Interface between the torch binding (bindings.cpp) and the plain-CUDA decode kernel.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace asynct {

constexpr int kChunk = 64;  // keys per CTA iteration; also the largest pool size served

struct DecodeArgs {
  const void* q;          // [B, Hq, D], rows 16-byte aligned
  const void* k_cache;    // [num_blocks, block_size, Hkv, D]
  const void* v_cache;
  const int* block_table;  // [B, max_blocks]
  const int* seq_lens;     // [B]
  const float* sigma;      // [Hq]
  void* out;               // [B, Hq, D] (strided)
  float* partial;          // [B, Hq, splits, D] fp32 when splits > 1, else null
  float scale;
  int pool;
  bool relu;
  int64_t sqb, sqh, sob, soh, sbt;
  int hkv, block_size;
};

cudaError_t asynci_decode_launch(const DecodeArgs& args, bool bf16, int head_dim, int group,
                                 int batch, int splits, cudaStream_t stream);

}  // namespace asynct
