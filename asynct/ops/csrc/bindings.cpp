// torch binding of the CUDA kernels: argument checks, the split-K scratch, the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "asynci_decode.h"

namespace {

void asynci_decode_cuda(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                        torch::Tensor seq_lens, torch::Tensor sigma, double scale,
                        int64_t pool_size, bool relu_pre, torch::Tensor out, int64_t splits) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1, "q must be CUDA [B, Hq, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "asynci_decode_cuda supports bf16/fp16");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == q.scalar_type(),
              "kv_cache must be contiguous [2, num_blocks, block_size, Hkv, D] of q's dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(),
              "out must match q");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(sigma.scalar_type() == at::kFloat && sigma.is_contiguous(), "sigma must be fp32");
  TORCH_CHECK(q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
              "q rows must be 16-byte aligned");
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == d && hq % hkv == 0, "q does not fit the cache");
  if (batch == 0) return;
  torch::Tensor partial;
  if (splits > 1)
    partial = torch::empty({batch, hq, splits, d}, q.options().dtype(at::kFloat));
  asynct::DecodeArgs a{};
  a.q = q.data_ptr();
  a.k_cache = kv_cache[0].data_ptr();
  a.v_cache = kv_cache[1].data_ptr();
  a.block_table = block_table.data_ptr<int>();
  a.seq_lens = seq_lens.data_ptr<int>();
  a.sigma = sigma.data_ptr<float>();
  a.out = out.data_ptr();
  a.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
  a.scale = static_cast<float>(scale);
  a.pool = static_cast<int>(pool_size);
  a.relu = relu_pre;
  a.sqb = q.stride(0);
  a.sqh = q.stride(1);
  a.sob = out.stride(0);
  a.soh = out.stride(1);
  a.sbt = block_table.stride(0);
  a.hkv = static_cast<int>(hkv);
  a.block_size = static_cast<int>(kv_cache.size(2));
  const cudaError_t err = asynct::asynci_decode_launch(
      a, q.scalar_type() == at::kBFloat16, static_cast<int>(d), static_cast<int>(hq / hkv),
      static_cast<int>(batch), static_cast<int>(splits), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "asynci_decode_cuda launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("asynci_decode_cuda", &asynci_decode_cuda, "paged AsyncI decode (CUDA)");
}
