"""Checkpoint bytes, save and load time: trainfold against a real ``transformers.Trainer``, in one process.

Run: ``.venv/bin/python benchmarks/checkpoint.py [--sizes small large] [--repeat 5] [--dir /tmp]``.

For each size a ``LlamaForCausalLM`` from config (random weights, float32) with AdamW state:

- **Trainer**: one ``Trainer.train`` step (so ``optimizer.pt`` holds both moments), then
  ``Trainer._save_checkpoint`` (``model.safetensors`` + ``config.json`` + ``generation_config.json``,
  ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``, ``training_args.bin``;
  no fsync) and the resume's loads (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
  ``_load_rng_state``, ``TrainerState.load_from_json``);
- **trainfold**: the save ``train`` does, ``Saver().save(state, path, model=model)`` of the same
  model's state with AdamW moments (``model.safetensors`` with the params, ``state.safetensors`` with
  the rest, the sidecar with every file's size and CRC-32, atomic rename; every file, the directory
  and its parent then fsynced in a background thread: "durable after" is the time until that ends),
  "blocking" the save with every fsync before the rename (``save_fsync="blocking"``, the old one);
  and the load a resume waits for before its first step: ``load(path, like=template, donate=True,
  crc_checked=True, frozen_checked=True)`` (the files read straight into the template's tensors)
  and ``verify_later(path, loaded=state)`` started (every byte's CRC-32, and a LoRA model's frozen
  base's fingerprints, checked in a thread beside the first steps; nothing is saved before it ends);
  "CRC-checked after" the time until that check ended; "inline-checked" the load that CRCs each
  4 MB piece as it reads it (``load(path, like=template, donate=True)``: what a resume under
  torchrun does); the template, built as a resume builds it, is made outside the timing, as the
  Trainer's model and optimizer are; "fresh" the inline-checked load into new memory
  (``load(path, like=state)``);
- ``--lora``: the same comparison of a ``peft`` LoRA model (r=8 on the attention projections), and
  trainfold's LoRA checkpoint against its full fine-tuning one.

Each timing is the median of ``--repeat`` runs, trainfold's and the Trainer's interleaved; the files
are in the page cache (a fresh directory per save, the same one for every load).
``crc.CRC32_BY`` (printed) says whether zlib's or ISA-L's CRC-32 ran (``pip install isal``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from trainfold.ckpt import crc, load, save, verify_later
from trainfold.ckpt.sharded import Saver
from trainfold.core.state import init_state
from trainfold.optim import adamw

SIZES = {  # name: (hidden, intermediate, layers, vocab); params and bytes in float32
    "tiny": (64, 128, 2, 512),
    "small": (256, 688, 4, 8000),  # 7.3M params: a 88 MB checkpoint
    "large": (768, 2048, 4, 8000),  # 40.6M params: a 487 MB checkpoint
}


def llama(size: str):
    import transformers

    hidden, inter, layers, vocab = SIZES[size]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def lora(model):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeat: int,
    setup: Callable[[], object] = lambda: None,
    before: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Return each function's median wall time, the functions run in turn ``repeat`` times.

    ``setup()`` runs before each round, ``before[name]()`` (untimed) before that function only.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        setup()
        for name, fn in fns.items():
            (before or {}).get(name, lambda: None)()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def hf_trainer(model, root: Path):
    """A Trainer that took one step, so its optimizer holds both AdamW moments."""
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(root / "hf"),
        max_steps=1,
        per_device_train_batch_size=2,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        learning_rate=1e-3,
    )
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def trainfold_state(model):
    """The state of ``model`` with AdamW moments of the Trainer's shapes, filled as after training."""
    state = init_state(model, adamw(1e-3))
    g = torch.Generator().manual_seed(1)
    mu = {k: torch.randn(v.shape, generator=g) for k, v in state.opt_state.mu.items()}
    nu = {k: torch.rand(v.shape, generator=g) for k, v in state.opt_state.nu.items()}
    return attrs.evolve(state, opt_state=attrs.evolve(state.opt_state, mu=mu, nu=nu))


def compare(model, root: Path, repeat: int) -> dict[str, float]:
    """Bytes and save/load seconds of one model's checkpoint, trainfold's and the Trainer's."""
    from transformers.trainer_callback import TrainerState

    trainer = hf_trainer(model, root)
    state = trainfold_state(trainer.model)
    hf_dir, tf_dir = root / "hf" / "checkpoint-1", root / "tf" / "saved"  # the state is of step 0

    saver = Saver(fsync="background")  # train's

    def clean() -> None:
        saver.wait()  # the previous save's background fsync is done (outside the timings)
        shutil.rmtree(hf_dir, ignore_errors=True)
        shutil.rmtree(tf_dir, ignore_errors=True)

    def durable() -> None:  # from the call until its background fsync ended
        saver.save(state, tf_dir, model=trainer.model)
        saver.wait()

    saving = interleaved(
        {
            "trainfold": lambda: saver.save(state, tf_dir, model=trainer.model),
            "durable": durable,
            "blocking": lambda: save(state, tf_dir, model=trainer.model),
            "trainer": lambda: trainer._save_checkpoint(trainer.model, trial=None),
        },
        repeat,
        before={name: clean for name in ("trainfold", "durable", "blocking", "trainer")},
    )
    saver.save(state, tf_dir, model=trainer.model)
    trainer._save_checkpoint(trainer.model, trial=None)
    saver.wait()

    def hf_load() -> None:
        trainer._load_from_checkpoint(str(hf_dir))
        trainer._load_optimizer_and_scheduler(str(hf_dir))
        trainer._load_rng_state(str(hf_dir))
        TrainerState.load_from_json(str(hf_dir / "trainer_state.json"))

    templates: list = []
    checks: list = []

    def settle() -> None:  # a resume's CRC check still running ends before the next timing (not timed)
        while checks:
            checks.pop().wait()

    def template() -> None:  # what a resume loads into: the state train builds before it (not timed)
        settle()
        templates[:] = [trainfold_state(trainer.model)]

    def resume() -> None:  # what train(resume_from_checkpoint=...) waits for before its first step
        loaded = load(tf_dir, like=templates.pop(), donate=True, crc_checked=True, frozen_checked=True)
        checks.append(verify_later(tf_dir, loaded=loaded))  # a LoRA base's fingerprints too

    def checked() -> None:  # until the CRC check that runs beside the first steps ended
        resume()
        checks.pop().wait()

    loading = interleaved(
        {
            "trainfold": resume,
            "checked": checked,
            "inline": lambda: load(tf_dir, like=templates.pop(), donate=True),
            "fresh": lambda: load(tf_dir, like=state),
            "trainer": hf_load,
        },
        repeat,
        before={"trainfold": template, "checked": template, "inline": template, "fresh": settle},
    )
    out = {
        "tf_bytes": dir_bytes(tf_dir),
        "hf_bytes": dir_bytes(hf_dir),
        "tf_save": saving["trainfold"],
        "tf_durable": saving["durable"],
        "tf_blocking": saving["blocking"],
        "hf_save": saving["trainer"],
        "tf_load": loading["trainfold"],
        "tf_checked": loading["checked"],
        "tf_inline": loading["inline"],
        "tf_fresh": loading["fresh"],
        "hf_load": loading["trainer"],
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }
    clean()
    return out


def row(name: str, r: dict[str, float]) -> str:
    return (
        f"| {name} | {r['params'] / 1e6:.2f}M / {r['trainable'] / 1e6:.2f}M | {r['tf_bytes'] / 1e6:.1f} | "
        f"{r['hf_bytes'] / 1e6:.1f} | {r['tf_bytes'] / r['hf_bytes']:.3f} | {r['tf_save']:.3f} | "
        f"{r['hf_save']:.3f} | {r['tf_save'] / r['hf_save']:.2f} | {r['tf_durable']:.3f} | "
        f"{r['tf_blocking'] / r['hf_save']:.2f} | {r['tf_load']:.3f} | {r['hf_load']:.3f} | "
        f"{r['tf_load'] / r['hf_load']:.2f} | {r['tf_checked']:.3f} | {r['tf_inline'] / r['hf_load']:.2f} | "
        f"{r['tf_fresh'] / r['hf_load']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "large"], choices=sorted(SIZES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="also compare LoRA checkpoints")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="trainfold-bench-"))
    results = []
    try:
        for size in args.sizes:
            results.append((f"{size}", compare(llama(size), root, args.repeat)))
            if args.lora:
                results.append((f"{size} LoRA", compare(lora(llama(size)), root, args.repeat)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"median of {args.repeat}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, CRC-32 by {crc.CRC32_BY}; bytes in MB, times in seconds"
    )
    print(
        "| model | params / trainable | trainfold bytes | Trainer bytes | ratio | trainfold save | Trainer save "
        "| ratio | durable after | blocking save ratio | trainfold load | Trainer load | ratio | CRC-checked after "
        "| inline-checked load ratio | fresh load ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results:
        print(row(name, r))
    full = dict(results)
    for size in args.sizes:
        if args.lora:
            a, b = full[f"{size} LoRA"], full[size]
            print(
                f"{size}: trainfold LoRA checkpoint / full fine-tuning: bytes {a['tf_bytes'] / b['tf_bytes']:.4f} "
                f"({a['tf_bytes'] / 1e6:.2f} vs {b['tf_bytes'] / 1e6:.1f} MB), save time "
                f"{a['tf_save'] / b['tf_save']:.3f} ({a['tf_save'] * 1e3:.1f} vs {b['tf_save'] * 1e3:.1f} ms)"
            )


if __name__ == "__main__":
    main()
