"""Issue 13 lead: the batch-1 kernel boundary as a counter, not a grid dependency. The engine's
decode-sized kernels launch early (programmatic dependent launch), load their weights, then
wait (`griddepcontrol.wait`) until the kernel before has exited and its memory is flushed. Here
each producer program adds one to a counter after its stores (release, after a CTA barrier) and
the consumer polls that counter (acquire) until every producer has added: its input is ready
before the producer's programs exit and before the grid completes. The chain is bench-0.6b's
MLP at one row, gate/up + ReGLU -> down + residual + the next DyHT, 35 layers with their own
weights in one CUDA graph, counters zeroed by one memset a step.

Modes of the same two kernels (`mode`): "grid" waits as the engine does (the peer that isolates
the boundary from the kernels' code); "count" polls counters and lets the next kernel launch
once its own programs have their input ("late"), or as soon as they start ("early": every later
kernel may launch and park programs; safe from deadlock because a kernel launches only after
every program of the one before has started, so whatever it polls is resident).

    cd benchmarks && PYTHONPATH=.. python3 mlp_flags.py           (a Hopper GPU)
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/mlp_flags.py --check   (CPU, small fp32 shapes)

Prints us a layer for the engine's pair and each mode, and each mode's largest difference from
the pair's hidden state after one layer, relative to its largest value."""
import argparse

import torch

from asynct.ops import fused_linear as fl
from asynct.ops._triton import gdc_launch_dependents, gdc_wait, jit, next_power_of_2, pdl, tl
from mlp_atomic import C, INTER, LAYERS, make_layers, one_layer_reference

MODES = {"grid": 0, "count late": 1, "count early": 2}


@jit
def _enter(cnt_ptr, target, MODE: tl.constexpr, PDL: tl.constexpr):
    """Waits for the input (MODE 0: the grid before; 1-2: target producers counted) and lets the
    next kernel launch (MODE 2 before waiting, else after)."""
    if PDL:
        if MODE == 2:
            gdc_launch_dependents()
        if MODE == 0:
            gdc_wait()
    if MODE > 0:
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while c < target:
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    if PDL:
        if MODE < 2:
            gdc_launch_dependents()


@jit
def _leave(cnt_ptr, MODE: tl.constexpr):
    if MODE > 0:    # every thread's stores before the one release that publishes them
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, cnt_in, cnt_out, target, I, K: tl.constexpr, KP: tl.constexpr,
                    HB: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.arange(0, 2 * HB)
    n = pid * HB + tl.where(j < HB, j, j - HB)
    rows = tl.where(j < HB, n, n + I)
    kk = tl.arange(0, KP)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=kk[None, :] < K, other=0.0)
    _enter(cnt_in, target, MODE, PDL)
    ty = h_ptr.dtype.element_ty
    x = tl.load(x_ptr + kk, mask=kk < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    gu = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(ty).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(gu, (2, HB)), (1, 0)))
    tl.store(h_ptr + pid * HB + tl.arange(0, HB), (tl.maximum(gate, 0.0) * up).to(ty))
    _leave(cnt_out, MODE)


@jit
def _down_kernel(h_ptr, w_ptr, r_in, r_out, x_out, a_ptr, dw_ptr, cnt_in, cnt_out, target, K: tl.constexpr,
                 KP: tl.constexpr, RB: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    kk = tl.arange(0, KP)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=kk[None, :] < K, other=0.0)
    a, dw = tl.load(a_ptr + rows), tl.load(dw_ptr + rows)
    _enter(cnt_in, target, MODE, PDL)
    ty = r_out.dtype.element_ty
    h = tl.load(h_ptr + kk, mask=kk < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = tl.sum(w.to(tl.float32) * h[None, :], axis=1).to(ty).to(tl.float32)
    hidden = (tl.load(r_in + rows, cache_modifier=".cg").to(tl.float32) + y).to(ty)
    tl.store(r_out + rows, hidden)
    tl.store(x_out + rows, (dw * tl.minimum(tl.maximum(a * hidden.to(tl.float32), -1.0), 1.0)).to(ty))
    _leave(cnt_out, MODE)


class Chain:
    """Buffers for `layers` MLPs at one row: x and r per layer boundary, h per layer, and two
    counters a layer (gate/up's programs done, down's programs done)."""

    def __init__(self, layers, a, dw, x0, r0, hb=2, rb=2, warps=4):
        c, inter = layers[0]["w_down"].shape
        dev, ty = x0.device, x0.dtype
        self.layers, self.a, self.dw, self.hb, self.rb, self.warps = layers, a, dw, hb, rb, warps
        n = len(layers)
        self.x, self.r = torch.empty(n + 1, c, dtype=ty, device=dev), torch.empty(n + 1, c, dtype=ty, device=dev)
        self.x[0], self.r[0] = x0.view(-1), r0.view(-1)
        self.h = torch.empty(n, inter, dtype=ty, device=dev)
        self.cnt = torch.zeros(2 * n, dtype=torch.int32, device=dev)
        self.c, self.inter = c, inter

    def step(self, mode):
        m, on = MODES[mode], pdl(self.x)
        gu_progs, down_progs = self.inter // self.hb, self.c // self.rb
        self.cnt.zero_()
        for i, layer in enumerate(self.layers):
            cin, target = (self.cnt[2 * i - 1], down_progs) if i else (self.cnt[0], 0)
            _gate_up_kernel[(gu_progs,)](self.x[i], layer["w_gu"], self.h[i], cin, self.cnt[2 * i], target,
                                         self.inter, K=self.c, KP=next_power_of_2(self.c), HB=self.hb, MODE=m,
                                         PDL=on, num_warps=self.warps, launch_pdl=on)
            _down_kernel[(down_progs,)](self.h[i], layer["w_down"], self.r[i], self.r[i + 1], self.x[i + 1],
                                        self.a, self.dw, self.cnt[2 * i], self.cnt[2 * i + 1], gu_progs,
                                        K=self.inter, KP=next_power_of_2(self.inter), RB=self.rb, MODE=m, PDL=on,
                                        num_warps=self.warps, launch_pdl=on)


def one_layer_difference(c, inter, dtype, device, mode):
    layer, a, dw, res, x, hidden, x_next = one_layer_reference(c, inter, dtype, device)
    chain = Chain([layer], a, dw, x, res)
    chain.step(mode)
    big = hidden.float().abs().max()
    return max(((chain.r[1] - hidden.view(-1)).float().abs().max() / big).item(),
               ((chain.x[1] - x_next.view(-1)).float().abs().max()).item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="small fp32 shapes (TRITON_INTERPRET=1 on a CPU)")
    args = ap.parse_args()
    if args.check:
        for mode in MODES:
            print(f"{mode}: max |diff| / max {one_layer_difference(64, 96, torch.float32, 'cpu', mode):.2e}")
        return
    from kernel_bench import bench
    gen = torch.Generator().manual_seed(0)
    layers, alpha, dw = make_layers(LAYERS, C, INTER, torch.bfloat16, "cuda", gen)
    x0 = torch.randn(1, C, device="cuda").to(torch.bfloat16)
    r0 = torch.randn(1, C, device="cuda").to(torch.bfloat16)

    def pair():
        x, r = x0, r0
        for layer in layers:
            r, x = fl.linear_dyht_add(fl.linear_reglu(x, layer["w_gu"]), layer["w_down"], r, alpha, dw)
    print(f"{torch.cuda.get_device_name()}: batch 1, {LAYERS} layers, hidden {C}, MLP {INTER}, bf16")
    base = bench([pair]) / LAYERS * 1e6
    print(f"engine gate/up -> down: {base:.2f} us a layer", flush=True)
    print("mode | HB | RB | warps | us a layer | engine / mode | max |diff| / max (one layer)")
    for hb, rb, warps in ((2, 2, 4), (4, 2, 4), (2, 4, 4), (4, 4, 8)):
        for mode in MODES:
            try:
                chain = Chain(layers, alpha, dw, x0, r0, hb, rb, warps)
                t = bench([lambda: chain.step(mode)]) / LAYERS * 1e6
                diff = one_layer_difference(C, INTER, torch.bfloat16, "cuda", mode)
            except Exception as e:  # a mode that does not compile is a result too
                print(f"{mode} | {hb} | {rb} | {warps} | {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            print(f"{mode} | {hb} | {rb} | {warps} | {t:.2f} | {base / t:.3f} | {diff:.2e}", flush=True)
    print(f"engine gate/up -> down again: {bench([pair]) / LAYERS * 1e6:.2f} us a layer")


if __name__ == "__main__":
    main()
