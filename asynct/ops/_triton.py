"""Triton, where it is installed. CPU-only installs get stand-ins so that the kernel definitions
still evaluate, and every op falls back to its torch reference."""
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

    class tl:  # noqa: N801  (lets `x: tl.constexpr` annotations evaluate)
        constexpr = None


def jit(fn=None, **options):
    """`triton.jit`, also as `jit(do_not_specialize=[...])`. Arguments that change from step to
    step (token counts, batch sizes, a block table's width, offsets into a batch) must be listed
    there: Triton specialises integers on `== 1` and `% 16` and pointers on 16-byte alignment,
    and every new combination is a compile in the middle of serving."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn
