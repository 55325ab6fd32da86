"""Triton, where it is installed. CPU-only installs get stand-ins so that the kernel definitions
still evaluate, and every op falls back to its torch reference."""
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

    class tl:  # noqa: N801  (lets `x: tl.constexpr` annotations evaluate)
        constexpr = None

jit = triton.jit if triton is not None else (lambda fn: fn)
