"""Under ``fsdp="full_shard"`` the module holds no full copy of the weights while the shards train (issue 18).

Run as a script, this file is the worker of the 2-process test::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_released.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerance import assert_within, causal_lm_eval_atol, causal_lm_run_bounds
from torchrun import torchrun_ok

from trainfold import TrainingArguments, train
from trainfold.data import pad_collate
from trainfold.hf.released import release

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def model():
    """A tiny Llama from config whose head is tied to its token embedding (one parameter in two slots)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=24, tie_word_embeddings=True, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def rows(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 40, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def train_args(out: Path, **over) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        seed=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=2,
    )
    return TrainingArguments(**{**base, **over})


# 2 ranks add a step's token terms in another order than 1 process (and FSDP's kernels may round
# each sum differently), so the runs use SGD with momentum, which passes that difference on unchanged
# in size, and the params are compared within the bound tests/tolerance.py derives. (AdamW's first
# step lr g / (|g| + eps) makes a gradient that cancels to about eps a step of up to lr: 1.05e-6
# after 4 steps on one machine, issue 30.)
LINEAR = {"optim": "sgd", "optim_args": "momentum=0.9"}


def _module_bytes(params) -> int:
    """Bytes of real (non-meta) storage behind ``params``."""
    return sum(p.untyped_storage().nbytes() for p in params if p.device.type != "meta")


def _worker(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = model()
    own = dict(net.named_parameters())  # the module's own Parameter objects (tied: once)
    seen: list[dict] = []

    def probe(state, logs) -> None:  # on every log, i.e. after each step: what the module holds now
        seen.append({"slots": _module_bytes(net.parameters()), "own": _module_bytes(own.values())})

    res = train(
        net,
        train_args(out / "run", fsdp="full_shard", **LINEAR),
        rows(),
        rows(6),
        data_collator=pad_collate(),
        observers=(probe,),
    )
    after = dict(net.named_parameters())
    save_file({k: v.detach().clone() for k, v in after.items()}, out / f"module-{rank}.safetensors")
    (out / f"probe-{rank}.json").write_text(
        json.dumps(
            {
                "seen": seen,
                "full": _module_bytes(own.values()),
                "same_objects": all(after[k] is own[k] for k in own) and list(after) == list(own),
                "tied": net.lm_head.weight is net.model.embed_tokens.weight,
                "evals": [h["eval_loss"] for h in res.log_history if "eval_loss" in h],
                "saved": [str(p) for p in res.last_checkpoint.parent.iterdir()] if res.last_checkpoint else [],
            }
        )
    )
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("released")
    torchrun_ok(__file__, out, nproc=WORLD)
    return out


@pytest.mark.slow  # 2 processes under torchrun
def test_the_module_holds_no_weights_while_sharded_training_runs_and_the_trained_ones_after(ranks, tmp_path):
    one = train(
        model(),
        train_args(tmp_path, **LINEAR, gradient_accumulation_steps=2 * WORLD, save_strategy="no"),
        rows(),
        rows(6),
        data_collator=pad_collate(),
    )
    full = sum(p.nbytes for p in model().parameters())
    args = train_args(tmp_path)
    bound, rtol, _ = causal_lm_run_bounds(
        model(), rows(), 8, one.log_history, args.learning_rate, 0.9, max_norm=args.max_grad_norm
    )
    for r in range(WORLD):
        got = json.loads((ranks / f"probe-{r}.json").read_text())
        assert len(got["seen"]) >= 4 and got["full"] == full  # a log per step; the full weights are back
        assert all(s == {"slots": 0, "own": 0} for s in got["seen"]), got["seen"]  # no storage while training
        assert got["same_objects"] and got["tied"]  # the module's own Parameters, tying kept
        expected = [h["eval_loss"] for h in one.log_history if "eval_loss" in h]
        assert len(got["evals"]) == len(expected) == 2  # eval on the shards, at params within the bound
        for mine, theirs in zip(got["evals"], expected):
            assert mine == pytest.approx(theirs, abs=causal_lm_eval_atol(model(), rows(6), bound, theirs), rel=0)
        module = load_file(ranks / f"module-{r}.safetensors")
        for k, v in one.state.params.items():
            assert_within(module[k], v, bound[k], rtol, k)  # see LINEAR


# -- one process -----------------------------------------------------------------------------------


def test_release_keeps_shapes_and_tying_and_restore_puts_the_same_objects_back():
    net = model()
    own = dict(net.named_parameters())
    shapes = {n: p.shape for n, p in net.named_parameters(remove_duplicate=False)}
    tied = [n for n in shapes if n not in own]
    held = release(net, frozenset(own))
    assert tied == ["lm_head.weight"]
    twins = dict(net.named_parameters(remove_duplicate=False))
    assert list(dict(net.named_parameters())) == list(own)  # a tied pair is still one parameter
    assert twins["lm_head.weight"] is twins["model.embed_tokens.weight"]
    assert all(t.device.type == "meta" and t.shape == shapes[n] for n, t in twins.items())
    assert all(p.numel() == 0 for p in own.values())
    trained = {k: torch.full(p.shape, 0.5) for k, p in model().named_parameters()}
    held.restore(trained.__getitem__)
    assert all(net.get_parameter(k) is p for k, p in own.items())
    assert all(torch.equal(p, trained[k]) for k, p in own.items())
    assert list(dict(net.named_parameters())) == list(own)


def test_release_leaves_frozen_params_alone():
    lin = torch.nn.Linear(2, 1)
    bias = lin.bias.detach().clone()
    release(lin, frozenset({"weight"}))
    assert lin.weight.device.type == "meta" and torch.equal(lin.bias, bias)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
