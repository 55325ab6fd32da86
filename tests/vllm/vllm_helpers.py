"""Helpers of the vLLM plugin tests (a unique module name: tests/ has its own conftest)."""
import importlib.util
import os

import torch


def real_vllm_installed() -> bool:
    """True only for the real vLLM: with tests/ on sys.path, this very directory imports as a
    namespace package named `vllm`, so neither `import vllm` nor find_spec alone can tell."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


HAVE_VLLM = real_vllm_installed()

# Mixed lengths: 1 token, under one block, across several small blocks, a long one to chunk.
PROMPT_LENGTHS = (1, 5, 23, 70)
MAX_TOKENS = 12


def make_prompts(vocab=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def perturb_dyht(ckpt_dir, seed=2):
    """Random DyHT alpha/weight (make_checkpoint leaves them at 1), so loading them matters."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(ckpt_dir, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith(("norm.alpha", "norm.weight", "layernorm.alpha", "layernorm.weight")):
            tensors[name] = t * (0.5 + torch.rand(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def reference_greedy(ckpt, prompts, max_tokens=MAX_TOKENS):
    """Greedy tokens of asynct's reference model (fp32, full recompute each step: no cache)."""
    import asynct  # noqa: F401  registers the Auto classes
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt):])
    return outs
