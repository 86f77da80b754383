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

``run(...)`` returns the mean reward of every optimizer step, so a test can run a short version.
"""

from __future__ import annotations

import argparse
import time

import torch

from trainfold import adamw, init_state, make_step
from trainfold.data import stream
from trainfold.generate import generate
from trainfold.grpo import grpo_objective, grpo_trajectory, make_rollout
from trainfold.models import TinyLM, TinyLMConfig, byte_decode, byte_encode
from trainfold.samplers import Sampler

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


def collate(items: list[dict]) -> dict[str, list]:
    """Collate prompt items into columns of plain lists (generation happens later)."""
    return {"prompt": [it["prompt"] for it in items]}


def run(steps: int = 300, seed: int = 0, prompts_per_step: int = 8, num_generations: int = 8,
        steps_per_generation: int = 2, lr: float = 3e-3, temperature: float = 1.0,
        scale_rewards: str = "group", log_every: int = 0) -> list[float]:
    """Train for ``steps`` optimizer steps; return each step's mean reward.

    Runs on one CPU thread (restored afterwards): for a model this small, more threads only add
    synchronisation, and on a shared machine they make it many times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(steps, seed, prompts_per_step, num_generations, steps_per_generation, lr, temperature, scale_rewards, log_every)
    finally:
        torch.set_num_threads(threads)


def _run(steps: int, seed: int, prompts_per_step: int, num_generations: int, steps_per_generation: int,
         lr: float, temperature: float, scale_rewards: str, log_every: int) -> list[float]:
    torch.manual_seed(seed)
    model = TinyLM(TinyLMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_len=16))
    optimizer = adamw(lr, weight_decay=0.0)
    state = init_state(model, optimizer, seed=seed)
    rollout = make_rollout(
        model, [digits, counting], encode=byte_encode, decode=byte_decode, num_generations=num_generations,
        max_new_tokens=COMPLETION_LENGTH, steps_per_generation=steps_per_generation, temperature=temperature,
        reward_weights=[0.5, 1.0], scale_rewards=scale_rewards,
    )
    step = make_step(model, optimizer=optimizer, objective=grpo_objective("grpo", temperature=temperature))
    sampler = Sampler("random", 10, per_device_train_batch_size=prompts_per_step, seed=seed)
    prompts = stream(prompts_dataset(), sampler, collate, max_steps=steps)
    rewards = []
    last = state
    for last in grpo_trajectory(step, state, prompts, rollout):
        rewards.append(last.metrics["reward"].item())
        if log_every and int(last.step) % log_every == 0:
            print(f"step {int(last.step):4d}  reward {rewards[-1]:.3f}  "
                  f"counting {last.metrics['rewards/counting/mean'].item():.3f}  loss {last.metrics['loss'].item():+.4f}")
    if log_every:
        samples = generate(model, last.params, [byte_encode(f"{d}>") for d in range(10)],
                           max_new_tokens=COMPLETION_LENGTH, temperature=0.0)
        print("greedy completions:", ", ".join(f"{d}>{byte_decode(c)}" for d, c in enumerate(samples)))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rewards = run(args.steps, args.seed, lr=args.lr, log_every=10)
    head, tail = rewards[:5], rewards[-5:]
    print(f"mean reward: first 5 steps {sum(head) / len(head):.3f}, last 5 steps {sum(tail) / len(tail):.3f} "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
