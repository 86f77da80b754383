"""GRPO on CPU in seconds: a tiny byte-level LM, from random weights, learns to write counting digits.

The prompts are ``"0>"`` .. ``"9>"``. Two plain Python reward functions score each 6-byte
completion: ``digits``, the fraction of its characters that are digits, and ``counting``, the
longest run of digits that count up by one (``"3456"`` scores 4/6). The total reward is
``0.5·digits + counting`` (at most 1.5). The model starts out emitting random bytes (mean reward
about 0.03), samples 8 completions per prompt, and learns from group-relative advantages: within
~300 optimizer steps (about 20 s on one CPU thread) every completion is a digit string with a
counting run of three or more, for a mean reward of about 1.0. Without an entropy bonus the small
policy then turns deterministic (``"456565"``) before reaching the optimum ``"123456"``: the
same collapse GRPO shows at scale.

    python examples/grpo_digits.py               # 300 steps, logs every 10
    python examples/grpo_digits.py --steps 40    # shorter

It runs ``trainfold.grpo.train`` with TRL's ``GRPOConfig`` names: 16 completions per
micro-batch, 2 micro-batches per optimizer step, one generation of 8 prompts x 8 completions every
``steps_per_generation=4`` micro-steps (2 optimizer steps), as TRL's ``GRPOTrainer`` would.
``run(...)`` returns the mean reward of every generation, so a test can run a short version.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import trainfold
from trainfold import GRPOArguments
from trainfold.core.generate import generate
from trainfold.core.models import TinyLM, TinyLMConfig, byte_decode, byte_encode

COMPLETION_LENGTH = 6


def digits(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Score the fraction of a completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / COMPLETION_LENGTH for c in completions]


def counting(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Score the longest run of digits that count up by one (``"3456"``: 4), over the completion length."""
    scores = []
    for c in completions:
        best = run = 0
        for i, ch in enumerate(c):
            steps_on = i > 0 and c[i - 1].isdigit() and ch == str((int(c[i - 1]) + 1) % 10)
            run = run + 1 if steps_on else int(ch.isdigit())
            best = max(best, run)
        scores.append(best / COMPLETION_LENGTH)
    return scores


def prompts_dataset() -> list[dict]:
    """Return the ten prompts ``"0>"`` .. ``"9>"``."""
    return [{"prompt": f"{d}>"} for d in range(10)]


def grpo_arguments(
    steps: int, seed: int = 0, lr: float = 3e-3, output_dir: str | None = None, **changes: object
) -> GRPOArguments:
    """Return the example's settings (TRL's names; constant learning rate, no clipping, no checkpoints)."""
    settings = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="grpo_digits_"),
        max_steps=steps,
        seed=seed,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_generations=8,
        max_completion_length=COMPLETION_LENGTH,
        reward_weights=[0.5, 1.0],
        loss_type="grpo",
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
    )
    return GRPOArguments(**{**settings, **changes})


def run(
    steps: int = 300,
    seed: int = 0,
    lr: float = 3e-3,
    temperature: float = 1.0,
    scale_rewards: str = "group",
    log_every: int = 0,
    output_dir: str | None = None,
) -> list[float]:
    """Train for ``steps`` optimizer steps; return each generation's mean reward (each log's, with ``log_every``).

    Runs on one CPU thread (restored afterwards): for a model this small, more threads only add
    synchronisation, and on a shared machine they make it many times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = TinyLM(TinyLMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_len=16))
        args = grpo_arguments(
            steps,
            seed,
            lr,
            output_dir,
            temperature=temperature,
            scale_rewards=scale_rewards,
            logging_steps=log_every or 1,
            log_level="passive" if log_every else "warning",
        )
        result = trainfold.grpo.train(
            model, args, prompts_dataset(), [digits, counting], codec=trainfold.grpo.Codec(byte_encode, byte_decode)
        )
    finally:
        torch.set_num_threads(threads)
    if log_every:
        samples = generate(
            model,
            result.state.params,
            [byte_encode(f"{d}>") for d in range(10)],
            max_new_tokens=COMPLETION_LENGTH,
            temperature=0.0,
        )
        print("greedy completions:", ", ".join(f"{d}>{byte_decode(c)}" for d, c in enumerate(samples)))
    return [entry["reward"] for entry in result.log_history if "reward" in entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rewards = run(args.steps, args.seed, lr=args.lr, log_every=10)
    head, tail = rewards[:5], rewards[-5:]
    print(
        f"mean reward: first 5 generations {sum(head) / len(head):.3f}, last 5 {sum(tail) / len(tail):.3f} "
        f"({time.perf_counter() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
