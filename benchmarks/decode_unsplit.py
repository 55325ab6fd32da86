"""Batch-1/2 decode without the split sum: one program a (sequence, KV head) walking every key
with deep software pipelining (a short context's tiles all in flight) or two splits, against the
engine's split grid + sum. decode_chain.py's QKV + decode + o_proj chains, 35 layers a graph, us
a layer. An ablation (fifteenth session, benchmarks/RESULTS.md): the engine's splits won.

    PYTHONPATH=. python3 benchmarks/decode_unsplit.py"""
import decode_chain as dc

VARIANTS = {"engine (graph max_len 4096)": dict(), "1 split, 64 keys, 2 stages": dict(splits=1),
            "1 split, 64 keys, 4 stages": dict(splits=1, num_stages=4),
            "1 split, 64 keys, 6 stages": dict(splits=1, num_stages=6),
            "1 split, 32 keys, 4 stages": dict(splits=1, block_n=32, num_stages=4),
            "1 split, 32 keys, 8 stages": dict(splits=1, block_n=32, num_stages=8),
            "1 split, 32 keys, 8 stages, 2 warps": dict(splits=1, block_n=32, num_stages=8, num_warps=2),
            "2 splits, 64 keys, 4 stages": dict(splits=2, num_stages=4),
            "2 splits, 32 keys, 6 stages": dict(splits=2, block_n=32, num_stages=6)}


def chain_us(b, context, max_len, **kw):
    dc.CONTEXT = context         # decode_chain's set-up reads it at call time
    return dc.chain_us(b, max_len, ("qkv", "decode", "o"), **kw)


def main():
    print("batch | context | variant | us a layer")
    for b in (1, 2):
        for context in (384, 1024):
            for name, kw in VARIANTS.items():
                try:
                    us = f"{chain_us(b, context, 4096, **kw):.2f}"
                except Exception as e:  # a config that does not fit is a result, not a crash
                    us = f"failed: {type(e).__name__} {str(e)[:80]}"
                print(f"{b} | {context} | {name} | {us}", flush=True)


if __name__ == "__main__":
    main()
