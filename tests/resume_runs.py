"""Runs that resume tests start in fresh processes: ``fn(output_dir, resume_from_checkpoint, observers)``.

Each builds its model from a seed inside the call (a fresh process must rebuild the same run) and
trains with ``enable_jit_checkpoint``: HF GPT-2 (``gelu_new`` calls ``torch.tanh``) and Llama with
attention dropout, both from small configs with random weights, and TinyLM with dropout.

Run as a script (the stress test does): ``python resume_runs.py MODEL OUTPUT_DIR MODE RESULT_DIR``
with MODE ``plain``, ``resume`` (from the latest checkpoint, if there is one) or ``hold`` (``plain``, then
print ``trained`` and wait for standard input to close before exiting); it prints ``ready``
once imported, builds and trains under a ``preemption_guard`` (so a SIGTERM while the model is
built is caught too), writes the result for ``trainfold.testing`` and exits 0 / 143 / 130.
``TRAINFOLD_TEST_NO_WARMUP=1`` switches the kernel warm-up off (to measure what it changes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from resume_fixture import ListDataset

from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.train import train

MAX_STEPS = 8
VOCAB = 64


def _rows(n: int = 32, seq_len: int = 16) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (n, seq_len), generator=g).tolist()
    return [{"input_ids": row, "labels": list(row)} for row in ids]


def _args(output_dir: str, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=output_dir,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=2,
        logging_steps=1,
        save_steps=3,
        save_total_limit=2,
        enable_jit_checkpoint=True,
        report_to="none",
        disable_tqdm=True,
        seed=5,
        use_cpu=True,
    )
    return TrainingArguments(**{**options, **overrides})


def _gpt2():
    import transformers  # here: the TinyLM runs never import it (a fresh process each)

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        activation_function="gelu_new",
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    return transformers.GPT2LMHeadModel(config)


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,
    )
    return transformers.LlamaForCausalLM(config)


def _tinylm():
    from trainfold.core.models import TinyLM, TinyLMConfig

    return TinyLM(TinyLMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_len=32, dropout=0.1))


MODELS = {"gpt2": _gpt2, "llama": _llama, "tinylm": _tinylm}


def run(name: str, output_dir: str, resume_from_checkpoint, observers=(), **overrides):
    """Build model ``name`` from seed 0 and train it; the signature ``check_resume`` calls (via the wrappers)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    return train(
        model,
        _args(output_dir, **overrides),
        ListDataset(_rows()),
        observers=observers,
        resume_from_checkpoint=resume_from_checkpoint or None,
    )


def gpt2(output_dir, resume_from_checkpoint, observers):
    return run("gpt2", output_dir, resume_from_checkpoint, observers)


def llama(output_dir, resume_from_checkpoint, observers):
    return run("llama", output_dir, resume_from_checkpoint, observers)


def tinylm(output_dir, resume_from_checkpoint, observers):
    return run("tinylm", output_dir, resume_from_checkpoint, observers)


def tinylm_without_jit(output_dir, resume_from_checkpoint, observers):
    return run("tinylm", output_dir, resume_from_checkpoint, observers, enable_jit_checkpoint=False)


def tinylm_other_data_on_resume(output_dir, resume_from_checkpoint, observers):
    """A run that does not resume bitwise: the resumed process trains on other rows."""
    torch.manual_seed(0)
    rows = _rows()
    if resume_from_checkpoint:
        rows = [{"input_ids": r["input_ids"][::-1], "labels": r["labels"][::-1]} for r in rows]
    return train(
        _tinylm(),
        _args(output_dir),
        ListDataset(rows),
        observers=observers,
        resume_from_checkpoint=resume_from_checkpoint or None,
    )


def _main(name: str, output_dir: str, mode: str, result_dir: str) -> int:
    import os

    from trainfold.ckpt import latest_checkpoint
    from trainfold.core.preempt import JIT_SIGNALS, exit_status, ignore_signals_until_exit, preemption_guard
    from trainfold.testing import dump_result

    if os.environ.get("TRAINFOLD_TEST_NO_WARMUP") == "1":
        sys.modules["trainfold.trainer.train"].warm_up_kernels = lambda *a, **k: None  # the module, not the function
    ignore_signals_until_exit(JIT_SIGNALS)  # what the guard restores on its way out: teardown never dies by -15
    with preemption_guard(JIT_SIGNALS):  # from here a SIGTERM stops the run cleanly; train shares the flag
        print("ready", flush=True)
        resume = mode == "resume" and latest_checkpoint(output_dir) is not None
        result = run(name, output_dir, resume)
        dump_result(result, result_dir)  # inside the guard: a signal after train returns ends nothing
    if mode == "hold":  # the run is over: say so, then wait until the test has signalled (stdin closed)
        print("trained", flush=True)
        sys.stdin.read()
    return exit_status(result.status, result.signal)


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:5]))
