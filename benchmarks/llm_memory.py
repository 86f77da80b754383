"""LLM memory and throughput: chunked cross-entropy, packing and padding-free batches.

Run: ``python benchmarks/llm_memory.py [--quick] [--device cuda]``. Prints two tables:

1. the loss alone (``hidden @ lm_head.T`` + cross-entropy, forward and backward) at vocab 32k / 128k /
   151k and sequence 512 / 2048: peak memory above the inputs (CPU: the child process's peak RSS; CUDA:
   ``max_memory_allocated``) and time, plain (``losses.causal_lm`` on full logits) vs chunked
   (``chunked_loss.chunked_cross_entropy``, 256-token chunks), each in a fresh process on the CPU;
2. training a small Llama on lognormal document lengths: real tokens per second and the fraction of
   computed positions that are padding, for ``random`` sampling (padded micro-batches), ``group_by_length``,
   packed rows (``packing.pack`` + ``packed_collate``) and padding-free micro-batches, all with the same
   number of documents per step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

HIDDEN = 256
CHUNK = 256  # tokens per chunk


def loss_child(vocab: int, seq: int, variant: str, device: str) -> dict[str, float]:
    """Measure one loss forward + backward (run in its own process on the CPU)."""
    import resource

    from trainfold.core.chunked_loss import chunked_cross_entropy
    from trainfold.core.losses import causal_lm, count_shifted_labels

    torch.manual_seed(0)
    hidden = (torch.randn(1, seq, HIDDEN, device=device) * 0.1).requires_grad_()
    weight = (torch.randn(vocab, HIDDEN, device=device) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, seq), device=device)
    n = count_shifted_labels(labels)

    def run() -> None:
        if variant == "plain":
            loss = causal_lm(hidden @ weight.T, labels, n)
        else:
            loss = chunked_cross_entropy(hidden[:, :-1], weight, labels[:, 1:], n, chunk_size=CHUNK)
        torch.autograd.grad(loss, (hidden, weight))

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # resident now, with the inputs; the lifetime peak after one run is the run's peak
        with open("/proc/self/statm") as f:
            base = int(f.read().split()[1]) * resource.getpagesize()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    rounds = 3
    start = time.perf_counter()
    for _ in range(rounds):
        run()
    if device == "cuda":
        torch.cuda.synchronize()
    return {"seconds": (time.perf_counter() - start) / rounds, "peak_bytes": float(peak)}


def loss_table(configs: list[tuple[int, int]], device: str) -> None:
    print(
        "| vocab | seq | plain peak (MiB) | chunked peak (MiB) | memory ratio "
        "| plain (ms) | chunked (ms) | time ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for vocab, seq in configs:
        out = {}
        for variant in ("plain", "chunked"):
            # The plain loss's peak is measured first in a fresh process: its logits are the process's largest tensors.
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(vocab), str(seq), variant, device],
                capture_output=True,
                text=True,
                check=True,
            )
            out[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        p, c = out["plain"], out["chunked"]
        mib = 1 << 20
        print(
            f"| {vocab} | {seq} | {p['peak_bytes'] / mib:.0f} | {c['peak_bytes'] / mib:.0f} | "
            f"{c['peak_bytes'] / max(p['peak_bytes'], 1):.2f} | {p['seconds'] * 1e3:.0f} | {c['seconds'] * 1e3:.0f} | "
            f"{c['seconds'] / p['seconds']:.2f} |"
        )


def lognormal_docs(n: int, cap: int, seed: int = 0) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(n).log_normal_(4.0, 0.9, generator=g).clamp(8, cap).long().tolist()
    out = []
    for k in lengths:
        ids = torch.randint(1, 256, (k,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def throughput_table(steps: int, docs_per_step: int) -> None:
    import transformers

    from trainfold import init_state, make_step, sgd
    from trainfold.core.losses import causal_lm
    from trainfold.data import pad_collate
    from trainfold.data.packing import pack, packed_collate, padding_free_collate
    from trainfold.data.samplers import Sampler

    cap = 512
    docs = lognormal_docs(steps * docs_per_step, cap)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=cap,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    opt = sgd(1e-3)
    step = make_step(model, causal_lm, opt)
    micro = 4  # documents per micro-batch for the padded strategies; the step holds docs_per_step documents
    n = len(docs)
    lengths = [len(d["input_ids"]) for d in docs]

    def padded_steps(order: list[int]) -> list[list[dict]]:
        return [
            [pad_collate()([docs[i] for i in order[s + m : s + m + micro]]) for m in range(0, docs_per_step, micro)]
            for s in range(0, n, docs_per_step)
        ]

    variants = {
        "random": padded_steps(Sampler("random", n, seed=1).order(0)),
        "group_by_length": padded_steps(
            Sampler("group_by_length", n, per_device_train_batch_size=docs_per_step, lengths=lengths, seed=1).order(0)
        ),
    }
    rows = pack(docs, max_length=cap)
    per_step = max(1, len(rows) // steps)
    variants["packed"] = [[packed_collate()(rows[s : s + per_step])] for s in range(0, len(rows), per_step)]
    order = Sampler("random", n, seed=1).order(0)
    variants["padding_free"] = [
        [
            padding_free_collate()([docs[i] for i in order[s + m : s + m + micro]])
            for m in range(0, docs_per_step, micro)
        ]
        for s in range(0, n, docs_per_step)
    ]
    print("\n| batches | real tokens/s | padded fraction | vs random |")
    print("|---|---|---|---|")
    base = None
    for name, batches in variants.items():
        state = init_state(model, opt)
        state = step(state, batches[0])  # warm up
        real = sum(lengths)  # every variant trains on every document once
        computed = sum(mb["input_ids"].numel() for b in batches for mb in b)
        start = time.perf_counter()
        for b in batches:
            state = step(state, b)
        rate = real / (time.perf_counter() - start)
        base = base or rate
        pad = 1 - real / computed
        print(f"| {name} | {rate:,.0f} | {pad:.3f} | {rate / base:.2f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        vocab, seq, variant, device = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
        print(json.dumps(loss_child(vocab, seq, variant, device)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one small loss config and a few steps (the suite runs it)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ns = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    configs = [(32_000, 1024)] if ns.quick else [(v, s) for v in (32_000, 128_256, 151_936) for s in (512, 2048)]
    loss_table(configs, ns.device)
    throughput_table(steps=2 if ns.quick else 12, docs_per_step=16)


if __name__ == "__main__":
    main()
