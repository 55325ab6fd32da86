"""Trains the tiny AsyncT shipped at models/tiny-gsm on locally generated arithmetic word problems.

The problems are in gsm8k's format ("Question: ...\\nAnswer: <steps>\\n#### <n>"), one or two
operations on small numbers, so a few-million-parameter byte-level model can learn them in a few
GPU minutes and lm-eval runs offline score something real. Held-out problems (the shipped eval
data) are generated from their own seed and never appear in training.

    # the shipped model, stage 1 (an H200, 170 s; 256-byte sequences; held-out exact match 100 %):
    PYTHONPATH=. python3 scripts/train_tiny.py --out /tmp/tiny-256 --max-seconds 170 --batch 128 \
        --log-every 250 --eval reference --eval-n 500
    # stage 2 (2-core CPU, 30 min): stretch the context to 768 bytes so 5-shot prompts work too
    PYTHONPATH=. python3 scripts/train_tiny.py --init-from /tmp/tiny-256 --out models/tiny-gsm \
        --seq-len 768 --batch 4 --lr 5e-4 --warmup 0.05 --max-seconds 1800 --log-every 5 --seed 1 --eval-n 200
    PYTHONPATH=. python3 scripts/train_tiny.py --write-tasks    # regenerate the shipped task data
"""
import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "asynct" / "integrations" / "tasks" / "tiny_gsm"
NAMES = ["Tom", "Sara", "Ali", "Mia", "Ben", "Lea", "Sam", "Zoe", "Max", "Ana", "Leo", "Eva"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "eggs", "stones", "shells", "cookies", "stickers"]

# Model shapes. `gpu` is the shipped one (~3.2 M parameters, 6.4 MB in bf16); `cpu` is a
# smaller one for trying the recipe on two cores.
SHAPES = {
    "gpu": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=32),
    "cpu": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32),
}


# ---- the problems ---------------------------------------------------------------------------
def _one_op(r: random.Random):
    n, it = r.choice(NAMES), r.choice(ITEMS)
    kind = r.choice("+-*/")
    if kind == "+":
        a, b = r.randint(1, 20), r.randint(1, 20)
        q = r.choice([f"{n} has {a} {it} and buys {b} more. How many {it} does {n} have now?",
                      f"{n} found {a} {it} on Monday and {b} {it} on Tuesday. How many {it} did {n} find in all?"])
        return q, [(a, "+", b, a + b)]
    if kind == "-":
        a = r.randint(2, 30)
        b = r.randint(1, a - 1)
        q = r.choice([f"{n} has {a} {it} and gives {b} to a friend. How many {it} does {n} have left?",
                      f"A box holds {a} {it}. {n} takes {b} {it} out. How many {it} are left in the box?"])
        return q, [(a, "-", b, a - b)]
    if kind == "*":
        a, b = r.randint(2, 9), r.randint(2, 9)
        q = f"{n} buys {a} bags with {b} {it} in each bag. How many {it} does {n} buy?"
        return q, [(a, "*", b, a * b)]
    b, c = r.randint(2, 9), r.randint(2, 9)
    q = f"{n} shares {b * c} {it} equally among {b} friends. How many {it} does each friend get?"
    return q, [(b * c, "/", b, c)]


def _two_op(r: random.Random):
    n, it = r.choice(NAMES), r.choice(ITEMS)
    kind = r.randrange(3)
    if kind == 0:
        a, b = r.randint(1, 20), r.randint(1, 20)
        c = r.randint(1, a + b - 1)
        q = f"{n} has {a} {it}, buys {b} more, then gives {c} away. How many {it} does {n} have now?"
        return q, [(a, "+", b, a + b), (a + b, "-", c, a + b - c)]
    if kind == 1:
        a, b, c = r.randint(2, 9), r.randint(2, 9), r.randint(1, 20)
        q = f"{n} has {a} boxes with {b} {it} in each box and finds {c} more {it}. How many {it} does {n} have?"
        return q, [(a, "*", b, a * b), (a * b, "+", c, a * b + c)]
    a, b = r.randint(2, 9), r.randint(2, 9)
    c = r.randint(1, a * b - 1)
    q = f"{n} buys {a} packs of {b} {it} and loses {c} of them. How many {it} does {n} have left?"
    return q, [(a, "*", b, a * b), (a * b, "-", c, a * b - c)]


def problem(r: random.Random) -> dict:
    q, steps = (_two_op if r.random() < 0.5 else _one_op)(r)
    answer = "\n".join(f"{a} {op} {b} = {c}" for a, op, b, c in steps) + f"\n#### {steps[-1][3]}"
    return {"question": q, "answer": answer}


def example(p: dict) -> str:
    """One problem as gsm8k's doc_to_text + " " + doc_to_target."""
    return f"Question: {p['question']}\nAnswer: {p['answer']}"


def held_out(n: int, seed: int = 1234) -> list[dict]:
    r, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        p = problem(r)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


def multiple_choice(p: dict, r: random.Random) -> dict:
    """The same problem with four candidate answers: the right one and three with a wrong result
    in the last step (so the model must do the arithmetic, not copy a number)."""
    final = int(p["answer"].rsplit("#### ", 1)[1])
    wrong = r.sample([d for d in (-3, -2, -1, 1, 2, 3) if final + d >= 0], 3)
    lines = p["answer"].split("\n")[:-1]

    def with_result(v):
        last = lines[-1].rsplit("= ", 1)[0] + f"= {v}"
        return "\n".join(lines[:-1] + [last]) + f"\n#### {v}"

    choices = [with_result(final + d) for d in [0] + wrong]
    r.shuffle(choices)
    return {"question": p["question"], "choices": choices, "label": choices.index(p["answer"])}


def write_tasks(n_gen=200, n_mc=200, n_bench=1319):
    """The shipped lm-eval data (jsonl): held-out problems, a multiple-choice version, and the
    1,319-problem benchmark set (gsm8k test's size)."""
    probs = held_out(n_gen + n_mc + n_bench)
    r = random.Random(7)
    files = {"test.jsonl": probs[:n_gen],
             "mc_test.jsonl": [multiple_choice(p, r) for p in probs[n_gen:n_gen + n_mc]],
             "bench_test.jsonl": probs[n_gen + n_mc:],
             "train.jsonl": [problem(random.Random(99 + i)) for i in range(16)]}  # few-shot pool
    TASKS.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (TASKS / name).write_text("".join(json.dumps(x) + "\n" for x in rows))
    print(f"wrote {', '.join(f'{k} ({len(v)})' for k, v in files.items())} to {TASKS}")


# ---- training -------------------------------------------------------------------------------
def batches(batch: int, seq_len: int, exclude: set, seed: int, device):
    """Endless batches of packed text: problems joined by a blank line (gsm8k's few-shot
    delimiter), so the model learns to stop an answer with "\\n\\n" and to read few-shot prompts."""
    r = random.Random(seed)
    buf: list[int] = []
    while True:
        while len(buf) < batch * (seq_len + 65):
            p = problem(r)
            if p["question"] not in exclude:
                buf.extend((example(p) + "\n\n").encode())
        rows = []
        for _ in range(batch):
            start = r.randrange(0, 64)  # random phase, so rows do not all start at "Question"
            rows.append(buf[start:start + seq_len + 1])
            del buf[:start + seq_len + 1]
        yield torch.tensor(rows, device=device)


def lr_at(progress, lr, warmup):
    """Linear warm-up over the first `warmup` fraction of the run, then cosine to 2 %."""
    if progress < warmup:
        return lr * max(progress / warmup, 0.01)
    return lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * (progress - warmup) / (1 - warmup))))


def train(args):
    import asynct  # noqa: F401  (registers the Auto classes)
    from asynct.config import AsyncTConfig
    from asynct.model.reference import AsyncTForCausalLM
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    # untied: a tied head would read the unit-std embeddings and start at loss ~50
    config = AsyncTConfig(vocab_size=259, max_position_embeddings=2048, tie_word_embeddings=False,
                          bos_token_id=258, eos_token_id=256, pad_token_id=257, torch_dtype="bfloat16",
                          **SHAPES[args.preset])
    if args.init_from:  # continue from a checkpoint (e.g. to stretch the context it was trained on)
        model = AsyncTForCausalLM.from_pretrained(args.init_from, dtype=torch.float32).to(device)
    else:
        model = AsyncTForCausalLM(config).to(device).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters on {device}", flush=True)
    # decay only matrices: DyHT alpha/weight and sigma are gains the clamps depend on
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    exclude = {p["question"] for p in held_out(args.held_out_exclude)}
    data = batches(args.batch, args.seq_len, exclude, args.seed, device)
    torch.backends.cuda.matmul.allow_tf32 = True
    on_gpu = device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    # the loss is summed on the device and read once per log interval: a .item() every step
    # would sync the GPU each step
    t0, step, loss_sum, n_sum, mean = time.perf_counter(), 0, 0.0, 0, float("nan")
    while True:
        # progress is steps or wall time, whichever is further along, so a GPU run ends on time
        progress = max(step / args.steps, (time.perf_counter() - t0) / args.max_seconds)
        if progress >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, args.lr, args.warmup)
        x = next(data)
        with amp:
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_sum, n_sum = loss_sum + loss.detach(), n_sum + 1
        step += 1
        if step % args.log_every == 0:
            mean, loss_sum, n_sum = float(loss_sum) / n_sum, 0.0, 0
            print(f"step {step:5d}  loss {mean:.4f} (mean of the last {args.log_every})  lr {g['lr']:.2e}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    if n_sum:
        mean = float(loss_sum) / n_sum
    print(f"trained {step} steps ({step * args.batch * args.seq_len / 1e6:.1f} M tokens)", flush=True)
    return model, mean, time.perf_counter() - t0


def save(model, out: Path):
    from asynct.model.tokenizer import save_byte_tokenizer
    model.to(torch.bfloat16).save_pretrained(out)
    save_byte_tokenizer(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved to {out} ({size / 1e6:.2f} MB)", flush=True)


def exact_match(p: dict, text: str) -> bool:
    m = re.search(r"#### (-?[0-9.,]+)", text)
    return bool(m) and m.group(1) == p["answer"].rsplit("#### ", 1)[1]


def accuracy_engine(model_dir: Path, n: int) -> float:
    """Greedy exact match on held-out problems through the engine (what lm-eval will score)."""
    from asynct import LLM, SamplingParams
    probs = held_out(n)
    llm = LLM(str(model_dir), max_num_seqs=256)
    outs = llm.generate([f"Question: {p['question']}\nAnswer:" for p in probs],
                        SamplingParams(temperature=0, max_tokens=64, stop=["\n\n", "Question:"]),
                        use_tqdm=False)
    return sum(exact_match(p, o.outputs[0].text) for p, o in zip(probs, outs)) / n


@torch.no_grad()
def accuracy_reference(model_dir: Path, n: int, device) -> float:
    """The same through the reference model's HF generate (left-padded batches, fp32 compute on
    the bf16-rounded weights): quick on a GPU where the engine would first compile kernels."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    probs, ok = held_out(n), 0
    for i in range(0, n, 250):
        chunk = probs[i:i + 250]
        enc = tok([f"Question: {p['question']}\nAnswer:" for p in chunk], return_tensors="pt",
                  padding=True).to(device)
        out = model.generate(**enc, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        ok += sum(exact_match(p, t.split("\n\n")[0]) for p, t in zip(chunk, texts))
    return ok / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "tiny-gsm")
    ap.add_argument("--preset", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="wall-time budget of the training loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", type=Path, default=None, help="start from this checkpoint's weights")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-n", type=int, default=500)
    ap.add_argument("--eval", choices=["engine", "reference"], default="engine")
    ap.add_argument("--held-out-exclude", type=int, default=4000,
                    help="problems of the held-out stream kept out of training (covers the shipped data)")
    ap.add_argument("--write-tasks", action="store_true", help="only write the shipped task data")
    args = ap.parse_args(argv)
    if args.write_tasks:
        write_tasks()
        return 0
    model, loss, seconds = train(args)
    save(model, args.out)
    device = next(model.parameters()).device
    acc = (accuracy_reference(args.out, args.eval_n, device) if args.eval == "reference"
           else accuracy_engine(args.out, args.eval_n))
    print(f"done: {seconds:.0f} s of training, final loss {loss:.4f}, held-out exact match "
          f"({args.eval}) {acc:.1%} on {args.eval_n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
