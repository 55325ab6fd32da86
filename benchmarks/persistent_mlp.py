"""A prototype for issue 13's batch-1 target: one token's MLP (gate/up + ReGLU, down + residual
+ the next DyHT) of all 35 layers as ONE persistent CUDA kernel whose phases meet at grid
barriers (persistent_mlp.cu), against the engine's two fused Triton kernels a layer (PDL
between them), bench-0.6b's shapes (hidden 1024, MLP 3072, bf16, random weights), graph-timed.
Prints us a layer, bandwidth against the copy roofline, and the ratio to the engine's kernels;
first it checks both against each other after 1 and 35 layers.

    PYTHONPATH=. python3 benchmarks/persistent_mlp.py          (CUDA + nvcc; ~10 s to build)

Variants (persistent_mlp.cu): the weights through registers (each warp's next rows loaded
before it waits) or streamed into shared memory by the TMA unit a whole phase ahead (8 or 16
warps, a copy a slice or a row); three grid barriers (sense-reversing; growing counters, one or
eight); the barriers alone; and the TMA kernel with parts left out (`work`), to attribute its time.

Measured (sixteenth session, benchmarks/RESULTS.md): with the best barrier (one growing counter,
~1.06 us a barrier) the persistent kernels run 0.98-1.04x the engine's pair, never faster by
more: a barrier costs what a PDL boundary costs, and the TMA stream around two barriers a layer
reaches 0.67-0.78 of copy bandwidth with nothing computed. Not part of the engine: it covers one
token and these shapes only."""
import ctypes
import hashlib
import os
import subprocess
import tempfile

import torch
from kernel_bench import bench, copy_bandwidth

from asynct.ops import fused_linear as fl

H, I, LAYERS = 1024, 3072, 35
BF = torch.bfloat16
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "persistent_mlp.cu")


def build():
    """The kernel as a shared library (nvcc, cached by source digest), through ctypes."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    src = open(SRC, "rb").read()
    so = os.path.join(tempfile.gettempdir(), f"persistent_mlp_{hashlib.sha1(src + arch.encode()).hexdigest()[:12]}.so")
    if not os.path.exists(so):
        subprocess.run(["nvcc", "-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-o", so, SRC], check=True)
    lib = ctypes.CDLL(so)
    lib.persistent_mlp.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_void_p]
    lib.persistent_mlp_blocks.argtypes = [ctypes.c_int]
    lib.persistent_mlp.restype = ctypes.c_int
    lib.persistent_mlp_blocks.restype = ctypes.c_int
    return lib


class State:
    def __init__(self, gen):
        self.w_gu = (torch.randn(LAYERS, 2 * I, H, device="cuda", generator=gen) * 0.02).to(BF)
        self.w_d = (torch.randn(LAYERS, H, I, device="cuda", generator=gen) * 0.02).to(BF)
        self.alpha = 0.5 + torch.rand(LAYERS, H, device="cuda", generator=gen)
        self.dyw = torch.randn(LAYERS, H, device="cuda", generator=gen)
        self.m0 = torch.randn(H, device="cuda", generator=gen).clamp(-1, 1).to(BF)
        self.r0 = torch.randn(H, device="cuda", generator=gen).to(BF)
        self.m, self.residual = self.m0.clone(), self.r0.clone()
        self.act = torch.empty(I, device="cuda", dtype=BF)
        self.bar = torch.zeros(1024, device="cuda", dtype=torch.int32)   # the barriers' counters

    def reset(self):
        self.m.copy_(self.m0)
        self.residual.copy_(self.r0)


REGISTERS, TMA, BARRIERS, TMA16, TMA16_ROWS = range(5)     # persistent_mlp.cu's kernels
KERNELS = {REGISTERS: "registers", TMA: "TMA ring", BARRIERS: "two grid barriers alone, no weights",
           TMA16: "TMA ring, 16 warps", TMA16_ROWS: "TMA ring, 16 warps, a copy a row"}
GRID_BARRIERS = ("sense-reversing", "one growing counter", "eight growing counters")
COUNTER = 1


def persistent(lib, s, first, last, blocks, variant, cooperative=False, work=3):
    ptrs = [t.data_ptr() for t in (s.w_gu, s.w_d, s.alpha, s.dyw, s.m, s.residual, s.act, s.bar)]
    rc = lib.persistent_mlp(*ptrs, first, last, blocks, int(cooperative), variant, work,
                            torch.cuda.current_stream().cuda_stream)
    if rc:
        raise RuntimeError(f"persistent_mlp launch failed: cudaError {rc}")


def engine_layers(s, m, r, layers):
    """The engine's decode path at one token: linear_reglu, then linear_dyht_add (fused Triton)."""
    for layer in layers:
        act = fl.linear_reglu(m.view(1, H), s.w_gu[layer])
        r, m = fl.linear_dyht_add(act, s.w_d[layer], r.view(1, H), s.alpha[layer], s.dyw[layer])
    return r.view(H), m.view(H)


def check(lib, s, blocks, variant, bound=0.2):
    """Worst |persistent - engine| / (1 + |engine|) of (residual, m) after 1 and all layers. Sums
    in another order round apart (a CPU emulation: ~4e-3 after one layer, ~0.06 after 35); a
    wrong row or a missed barrier is O(1), past `bound`, and raises, as does a non-finite value."""
    out = []
    for last in (1, LAYERS):
        s.reset()
        persistent(lib, s, 0, last, blocks, variant, cooperative=True)
        r, m = engine_layers(s, s.m0, s.r0, range(last))
        torch.cuda.synchronize()
        errs = torch.stack([((got.float() - want.float()).abs() / (1 + want.float().abs())).max()
                            for got, want in ((s.residual, r), (s.m, m))])
        err = errs.max().item()
        if not torch.isfinite(errs).all() or err > bound:
            raise SystemExit(f"persistent_mlp variant {variant} disagrees with the engine after {last} "
                             f"layer(s): {errs.tolist()}")
        out.append(err)
    return out


def grid(lib, variant):
    blocks = lib.persistent_mlp_blocks(variant)
    if blocks <= 0:
        raise SystemExit(f"cudaError {-blocks}" if blocks else f"variant {variant} cannot keep one block on every SM")
    return blocks


def main():
    lib = build()
    variants = [3 * k + b for k in (REGISTERS, TMA, BARRIERS) for b in range(len(GRID_BARRIERS))]
    variants += [3 * TMA16 + COUNTER, 3 * TMA16_ROWS + COUNTER]
    name = {v: f"{KERNELS[v // 3]}, {GRID_BARRIERS[v % 3]}" for v in variants}
    blocks = {v: grid(lib, v) for v in variants}
    s = State(torch.Generator(device="cuda").manual_seed(0))
    for v in variants:
        if v // 3 != BARRIERS:
            one, all_ = check(lib, s, blocks[v], v)
            print(f"{torch.cuda.get_device_name()}, {blocks[v]} blocks; {name[v]} vs engine, worst scaled "
                  f"difference: 1 layer {one:.2e}, {LAYERS} layers {all_:.2e}", flush=True)
    copy_bw = copy_bandwidth()
    nbytes = 3 * H * I * 2                      # one layer's MLP weights
    s.reset()
    peer = bench([lambda: engine_layers(s, s.m, s.residual, range(LAYERS))]) / LAYERS
    times = {"engine: linear_reglu + linear_dyht_add (Triton, PDL)": peer}
    for v in variants:
        times[f"{name[v]}, one launch for 35 layers"] = bench(
            [lambda v=v: persistent(lib, s, 0, LAYERS, blocks[v], v)]) / LAYERS
    for v in (3 * TMA + COUNTER, 3 * TMA16 + COUNTER):
        times[f"{name[v]}, one launch a layer"] = bench(
            [lambda v=v: [persistent(lib, s, i, i + 1, blocks[v], v) for i in range(LAYERS)]]) / LAYERS
        for work, label in ((0, "loads and barriers only"), (1, "+ inputs staged"), (2, "+ dots, inputs not staged")):
            times[f"{name[v]}, {label}"] = bench([lambda v=v, w=work: persistent(lib, s, 0, LAYERS, blocks[v], v,
                                                                               work=w)]) / LAYERS
    print(f"copy bandwidth {copy_bw:.2f} TB/s; one layer's MLP weights {nbytes / 1e6:.1f} MB "
          f"(roofline {nbytes / copy_bw / 1e6:.2f} us)")
    print("variant | us a layer | TB/s | x copy | engine / this")
    for label, t in times.items():
        print(f"{label} | {t * 1e6:.2f} | {nbytes / t / 1e12:.2f} | {nbytes / t / 1e12 / copy_bw:.2f} | {peer / t:.2f}")


if __name__ == "__main__":
    main()
