"""Issue 13 lead: a layer's MLP at batch 1 as one kernel instead of the engine's gate/up -> down
pair. Each program computes HB intermediate columns (gate/up rows and ReGLU, as the engine's
GEMV) and multiplies them straight into down's matching columns (down stored transposed,
[I, hidden], so a program's rows are contiguous), adding its hidden-sized partial into fp32 sums
by relaxed atomics: down's K is split over the gate/up programs. The sums' residual add and the
next DyHT move into the next kernel's prologue: here the next layer's MLP kernel (in a whole
layer, QKV and o_proj would take them, as o_proj takes the decode's sums). Sums zeroed by one
memset at the step's start: an upper bound, as decode_atomic.py's first prototype was.

    cd benchmarks && PYTHONPATH=.. python3 mlp_atomic.py          (an H200: 35 layers, bench-0.6b's MLP)
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/mlp_atomic.py --check   (CPU, small fp32 shapes)

Prints us a layer of 35 layers in one CUDA graph (each its own weights) for the engine's pair and
for the one kernel at several HB and warps, and the one kernel's largest difference from the
pair's hidden state after one layer, relative to its largest value."""
import argparse

import torch

from asynct import ops
from asynct.ops import fused_linear as fl
from asynct.ops._triton import jit, pdl_args, tl, wait_for_prior

C, INTER, LAYERS = 1024, 3072, 35


@jit
def _mlp_atomic_kernel(sums_in, res_in, res_out, w_gu, w_dt, sums_out, a_ptr, dw_ptr, I, K: tl.constexpr,
                       HB: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.arange(0, 2 * HB)
    n = pid * HB + tl.where(j < HB, j, j - HB)
    rows = tl.where(j < HB, n, n + I)
    kk = tl.arange(0, K)
    # weights and norm parameters before the wait: no kernel writes them
    w = tl.load(w_gu + rows.to(tl.int64)[:, None] * K + kk[None, :])
    wd = tl.load(w_dt + (pid * HB + tl.arange(0, HB)).to(tl.int64)[:, None] * K + kk[None, :])
    a = tl.load(a_ptr + kk)
    dw = tl.load(dw_ptr + kk)
    wait_for_prior(PDL)
    ty = res_out.dtype.element_ty
    hidden = (tl.load(sums_in + kk) + tl.load(res_in + kk).to(tl.float32)).to(ty)   # as the engine rounds it
    if pid == 0:
        tl.store(res_out + kk, hidden)
    x = (dw * tl.minimum(tl.maximum(a * hidden.to(tl.float32), -1.0), 1.0)).to(ty).to(tl.float32)
    gu = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(ty).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(gu, (2, HB)), (1, 0)))
    h = (tl.maximum(gate, 0.0) * up).to(ty).to(tl.float32)
    part = tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
    tl.atomic_add(sums_out + kk, part, sem="relaxed")


def mlp_atomic(sums_in, res_in, res_out, w_gu, w_dt, sums_out, a, dw, hb, warps):
    inter, k = w_dt.shape
    _mlp_atomic_kernel[(inter // hb,)](sums_in, res_in, res_out, w_gu, w_dt, sums_out, a, dw, inter, K=k, HB=hb,
                                       num_warps=warps, **pdl_args(res_in))


def make_layers(n, c, inter, dtype, device, gen):
    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)
    layers = []
    for _ in range(n):
        w_gu, w_down = rand(2 * inter, c, scale=c ** -0.5), rand(c, inter, scale=inter ** -0.5)
        layers.append(dict(w_gu=w_gu, w_down=w_down, w_dt=w_down.t().contiguous()))
    a = (torch.rand(c, generator=gen) * 2 + 0.2).to(device)
    dw = torch.randn(c, generator=gen).to(device)
    return layers, a, dw


def one_layer_reference(c, inter, dtype, device):
    """One layer's weights, its residual and DyHT'd input, and the engine's pair's hidden state
    and next input from them (the torch references off the GPU): what a prototype must match."""
    gen = torch.Generator().manual_seed(0)
    (layer,), a, dw = make_layers(1, c, inter, dtype, device, gen)
    res = (torch.randn(1, c, generator=gen) * 2).to(dtype).to(device)
    x = ops.dyht(res, a, dw)
    hidden, x_next = fl.linear_dyht_add(fl.linear_reglu(x, layer["w_gu"]), layer["w_down"], res, a, dw)
    return layer, a, dw, res, x, hidden, x_next


def one_layer_difference(c, inter, dtype, device, hb, warps):
    """The one kernel against the pair, one layer."""
    layer, a, dw, res, _, hidden, _ = one_layer_reference(c, inter, dtype, device)
    sums_in, sums_out = torch.zeros(c, device=device), torch.zeros(c, device=device)
    res_out = torch.empty(c, dtype=dtype, device=device)
    mlp_atomic(sums_in, res.view(-1), res_out, layer["w_gu"], layer["w_dt"], sums_out, a, dw, hb, warps)
    assert torch.equal(res_out, res.view(-1))
    got = sums_out + res.view(-1).float()
    return ((got - hidden.view(-1).float()).abs().max() / hidden.float().abs().max()).item()


def chain_us(layers, a, dw, variant):
    """us a layer: the engine's pair (variant None) or the one kernel (hb, warps)."""
    dev, dtype = a.device, layers[0]["w_gu"].dtype
    gen = torch.Generator(device=dev).manual_seed(1)
    res0 = torch.randn(1, C, device=dev, generator=gen).to(dtype)
    x0 = torch.randn(1, C, device=dev, generator=gen).to(dtype)
    sums = torch.zeros(LAYERS + 1, C, device=dev)
    res = torch.empty(LAYERS + 1, C, dtype=dtype, device=dev)
    res[0] = res0

    def step():
        if variant is None:
            x, r = x0, res0
            for layer in layers:
                r, x = fl.linear_dyht_add(fl.linear_reglu(x, layer["w_gu"]), layer["w_down"], r, a, dw)
            return
        sums.zero_()
        for i, layer in enumerate(layers):
            mlp_atomic(sums[i], res[i], res[i + 1], layer["w_gu"], layer["w_dt"], sums[i + 1], a, dw, *variant)
    from kernel_bench import bench
    return bench([step]) / LAYERS * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="small fp32 shapes (TRITON_INTERPRET=1 on a CPU)")
    a = ap.parse_args()
    variants = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8), (16, 8)]
    if a.check:
        for hb, warps in variants[:4]:
            print(f"HB {hb}: max |diff| / max {one_layer_difference(64, 96, torch.float32, 'cpu', hb, warps):.2e}")
        return
    gen = torch.Generator().manual_seed(0)
    layers, alpha, dw = make_layers(LAYERS, C, INTER, torch.bfloat16, "cuda", gen)
    base = chain_us(layers, alpha, dw, None)
    print(f"{torch.cuda.get_device_name()}: batch 1, {LAYERS} layers, hidden {C}, MLP {INTER}, bf16")
    print(f"engine gate/up -> down: {base:.2f} us a layer")
    print("HB | warps | programs | one kernel us a layer | engine / one kernel | max |diff| / max (one layer)")
    for hb, warps in variants:
        try:
            t = chain_us(layers, alpha, dw, (hb, warps))
            diff = one_layer_difference(C, INTER, torch.bfloat16, "cuda", hb, warps)
        except Exception as e:     # a variant that does not compile or fit is a result too
            print(f"{hb} | {warps} | {INTER // hb} | {type(e).__name__}: {str(e)[:80]}")
            continue
        print(f"{hb} | {warps} | {INTER // hb} | {t:.2f} | {base / t:.3f} | {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
