"""Triton, where it is installed. CPU-only installs get stand-ins so that the kernel definitions
still evaluate, and every op falls back to its torch reference."""
import functools
import os
from operator import itemgetter

from torch import Tensor as _Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

    class tl:  # noqa: N801  (lets `x: tl.constexpr` annotations evaluate)
        constexpr = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:     # a Triton before 3.4: the kernels launch plainly
    gdc_launch_dependents = gdc_wait = None

# Programmatic dependent launch: off only for the same-run peer of benchmarks/small_batch.py
PDL = True


def jit(fn=None, **options):
    """`triton.jit`, also as `jit(do_not_specialize=[...])`. Arguments that change from step to
    step (token counts, batch sizes, a block table's width, offsets into a batch) must be listed
    there: Triton specialises integers on `== 1` and `% 16` and pointers on 16-byte alignment,
    and every new combination is a compile in the middle of serving."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code. Triton 3.6's is a constexpr function whose Python wrapper cost
    ~1.9 us a call (a CPU core of this project's CI machine), and a mixed step's eager attention
    launches made 14 such calls a layer; this is plain arithmetic."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host code (see cdiv), 0 for 0 as Triton's."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pow2(n: int) -> bool:
    """Whether n is a power of two: the head sizes the Triton kernels' tl.arange takes."""
    return n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def _pdl_device(device_index) -> bool:
    import torch
    return (gdc_wait is not None and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device_index) >= (9, 0))


def pdl(t) -> bool:
    """Whether kernels on `t`'s device launch with programmatic dependent launch (Hopper on): a
    kernel's programs start while the kernel before finishes (a decode-sized layer is a chain of
    kernels of a few microseconds, each otherwise paying launch and ramp-up after the last one
    drains). Every such kernel calls `wait_for_prior` before it reads what an earlier kernel
    wrote and before it writes anything."""
    return PDL and t.is_cuda and _pdl_device(t.device.index or 0)


def pdl_args(t, wanted=True) -> dict:
    """The launch options and the kernel's PDL flag for a launch on `t`'s device."""
    on = wanted and pdl(t)
    return dict(PDL=on, launch_pdl=on)


class KernelLaunch:
    """A Triton kernel's launch on one grid with fixed options, made again and again (a step's
    attention, once a layer): the first call goes through Triton's JIT, the later ones straight
    to the compiled kernel it returned, wherever the arguments specialise as the first call's
    did (each tensor's dtype and 16-byte alignment, every other argument equal), else through
    the JIT again. Triton 3.6's JIT binds, specialises and keys every argument on every call:
    a 30-argument kernel cost ~45 us of host time a launch on an H100's host, the compiled
    kernel's own launch ~12 (benchmarks/RESULTS.md), and a mixed step's eager attention
    launches 70-105 of them. Arguments: the kernel's parameters in order, the trailing ones
    (constexprs) by name."""

    def __init__(self, fn, grid, kept=False, **options):
        self.fn, self.grid, self.options = fn, tuple(grid) + (1,) * (3 - len(grid)), options
        self.names = getattr(fn, "arg_names", ())
        self.runner = self.spec = self.first = None
        self.kept = kept     # cached_launch's: its specialisation is taken at once, no arguments held

    def __call__(self, *args, **params):
        values = args + tuple(params[n] for n in self.names[len(args):])
        if self.runner is not None:
            # the JIT call's specialisation, worked out only once a second call comes: a launch
            # made once (an unplanned op call) pays nothing for it
            self.spec = self.spec or _Specialisation(self.first)
            if self.spec.matches(values):
                self.runner(*values)
                return
        kernel = self.fn[self.grid](*args, **params, **self.options)
        # the interpreter (TRITON_INTERPRET=1) returns no compiled kernel: always through the JIT
        compiled = hasattr(kernel, "packed_metadata")
        self.runner = kernel[self.grid] if compiled else None
        # a launch kept for the process's life (cached_launch) must not hold its arguments: the
        # tensors of its first call (a step's [rows, vocab] logits) would never be freed
        self.first = values if compiled and not self.kept else None
        self.spec = _Specialisation(values) if compiled and self.kept else None


_cached_launches: dict = {}


def cached_launch(fn, grid, key=(), **options) -> KernelLaunch:
    """`fn`'s KernelLaunch on `grid`, kept for every later call with the same `key`: an eager op
    launched every step then goes straight to its compiled kernel. The key holds whatever
    changes from call to call and would otherwise make a launch specialise unlike the last
    (a dtype, an op code, a constexpr), so that calls of each kind keep their own."""
    launch_key = (fn, tuple(grid), key)     # callers put the device in `key`: a compiled kernel is one device's
    if launch_key not in _cached_launches:
        _cached_launches[launch_key] = KernelLaunch(fn, grid, kept=True, **options)
    return _cached_launches[launch_key]


class _Specialisation:
    """How a launch's arguments specialised: each tensor's dtype and 16-byte alignment, every
    other argument's value, and every argument's type (so that no tensor is ever compared with a
    number). `matches` checks another launch's arguments in ~7 us on a CI core, where one pass
    over them all in Python took 20: a planned step makes ~100 such launches."""

    def __init__(self, values):
        at = [isinstance(a, _Tensor) for a in values]
        self.tensors = _picker([i for i, t in enumerate(at) if t])
        self.others = _picker([i for i, t in enumerate(at) if not t])
        self.types, self.values = tuple(map(type, values)), self.others(values)
        self.dtypes, self.aligned = _tensor_spec(self.tensors(values))

    def matches(self, values) -> bool:
        if tuple(map(type, values)) != self.types or self.others(values) != self.values:
            return False
        return _tensor_spec(self.tensors(values)) == (self.dtypes, self.aligned)


def _tensor_spec(tensors) -> tuple[list, list]:
    return [t.dtype for t in tensors], [t.data_ptr() % 16 == 0 for t in tensors]


def _picker(at: list):
    """values -> the tuple of values[i] for i in `at` (itemgetter gives a bare value for one)."""
    if len(at) == 1:
        i = at[0]
        return lambda values: (values[i],)
    return itemgetter(*at) if at else (lambda values: ())


@jit
def wait_for_prior(PDL: tl.constexpr):
    """Waits until the kernel before has finished and its writes are visible, then lets the
    next kernel's programs start. Signalled only here, after the wait, so that at most one
    kernel runs ahead: signalled at a kernel's start, every later kernel of the step would
    launch at once and park its programs on the SMs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@jit
def prefetch_l2(ptrs):
    """Asks L2 for the cache lines holding `ptrs`: a hint that keeps no data in registers and
    waits for nothing. A program launched early (PDL) prefetches its weights this way while the kernel
    before still runs, then reads them from L2 after its wait."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)
