"""Sharded checkpoints: safetensors + JSON only, resharded on load (2 -> 1, 2, 4 ranks), atomic and async.

Run as a script, this file is the worker of the multi-process tests::

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/test_sharded_checkpoint.py PHASE OUT_DIR

Every process builds the same full state from a seed, shards its params and optimizer state as
``Shard(0)`` DTensors over a 1-D mesh of all ranks (``distribute_tensor``), and saves or loads it;
what each rank ends with is written under ``OUT_DIR`` for the tests to compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import attrs
import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file
from torchrun import torchrun_ok

from trainfold import ckpt
from trainfold.ckpt import faults
from trainfold.ckpt import sharded as sc
from trainfold.core.state import init_state
from trainfold.core.tree import flatten, map_tensors
from trainfold.optim import adamw

ROOT = Path(__file__).resolve().parents[1]


def shard_file(rank: int, world: int) -> str:
    """Rank ``rank``'s shard file, as DCP's ``HuggingFaceStorageWriter`` names it, in the checkpoint's ``sharded/``."""
    return f"{ckpt.SHARD_DIR}/shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


STEP = 3


def hf_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.config.pad_token_id = 0  # ragged rows: the default collator pads with the model's pad id (same weights)
    return model


def full_state(model):
    """The same state in every process: params and Adam moments drawn from a seed, step 3."""
    from trainfold.core.state import scalar

    state = init_state(model, adamw(1e-3), seed=7)
    g = torch.Generator().manual_seed(1)
    noisy = map_tensors(lambda t: t + 0.01 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t, state)
    return attrs.evolve(noisy, step=scalar(STEP))


def shard(state, mesh):
    """Params and optimizer state as Shard(0) DTensors over ``mesh``; counters and buffers stay plain."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def one(t):
        return distribute_tensor(t, mesh, [Shard(0)]) if t.dim() >= 1 and t.is_floating_point() else t

    return attrs.evolve(state, params=map_tensors(one, state.params), opt_state=map_tensors(one, state.opt_state))


def local_slabs(state) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone().contiguous()
        for k, v in flatten(state).items()
    }


# elastic resume through train(fsdp="full_shard"): 2 ranks x batch 2 (global 4), checkpoint-4 resumed on 1, 2, 4 ranks


def tiny():
    from trainfold.core.models import TinyLM, TinyLMConfig

    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_len=24))


def rows(n: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 40, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def run_args(out: Path, **over):
    from trainfold import TrainingArguments

    return TrainingArguments(
        **{
            "output_dir": str(out),
            "max_steps": 8,
            "per_device_train_batch_size": 2,
            "learning_rate": 1e-2,
            "warmup_steps": 2,
            "weight_decay": 0.1,
            "max_grad_norm": 1.0,
            "optim": "sgd",  # linear in the gradients: runs on other numbers of ranks are compared within a bound
            "optim_args": "momentum=0.9",
            "seed": 11,
            "logging_steps": 1,
            "save_strategy": "steps",
            "save_steps": 4,
            "report_to": "none",
            "disable_tqdm": True,
            **over,
        }
    )


def elastic_run(out: Path, resume=None, **over):
    from trainfold import train

    return train(tiny(), run_args(out, **over), rows(), resume_from_checkpoint=resume)


def gathered(state):
    """The state with every DTensor as its full tensor (a collective: every rank calls it)."""
    return map_tensors(lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t, state)


def trained(result) -> dict[str, torch.Tensor]:
    flat = flatten(gathered(result.state))
    tensors = {k: v.detach().clone().contiguous() for k, v in flat.items() if k.startswith(("params.", "opt_state."))}
    logged = [h for h in result.log_history if "loss" in h and "train_loss" not in h]
    losses, norms = [h["loss"] for h in logged], [h["grad_norm"] for h in logged]
    return {**tensors, "losses": torch.tensor(losses, dtype=torch.float64), "grad_norms": torch.tensor(norms)}


def _resume_copy(out: Path, name: str, rank: int, source: str = "straight", **over):
    """Resume checkpoint-4 of the sharded 2-rank run (or ``source``), sharded, in a copy of its output_dir (made by
    rank 0); ``over``: TrainingArguments changed for the resumed run."""
    import shutil

    import torch.distributed as dist

    if rank == 0:
        shutil.copytree(out / source, out / name)
    dist.barrier()
    return elastic_run(out / name, resume=str(out / name / "checkpoint-4"), fsdp="full_shard", **over)


# -- the worker ------------------------------------------------------------------------------------


def _worker(phase: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if phase == "save":
        model = hf_model()
        state = shard(full_state(model), mesh)
        sync = out / "sync" / f"checkpoint-{STEP}"
        sc.save_sharded(state, sync, model=model, consolidate=True, settings={"world_size": 2})
        saver = sc.Saver(async_save=True)
        path = saver.save(state, out / "async" / f"checkpoint-{STEP}", model=model)
        assert saver.wait() == path
        loaded = ckpt.load(out / "sync" / f"checkpoint-{STEP}", like=shard(init_state(hf_model(), adamw(1e-3)), mesh))
        save_file(local_slabs(loaded), out / f"loaded-2-{rank}.safetensors")
        save_file(local_slabs(state), out / f"saved-2-{rank}.safetensors")
        _failing_async_save(saver, state, out / "faulty", rank)
        uneven = shard(
            attrs.evolve(
                init_state(torch.nn.Linear(3, 1), adamw(1e-3)),
                params={"weight": torch.ones(1, 3), "bias": torch.full((1,), 2.0)},
            ),
            mesh,
        )
        # rank 1's shards: empty
        back = ckpt.load(sc.save_sharded(uneven, out / "uneven" / "checkpoint-0"), like=uneven)
        save_file({k: v.full_tensor() for k, v in back.params.items()} | local_slabs(back), out / f"uneven-{rank}.st")
        from trainfold import train

        straight = elastic_run(out / "straight", fsdp="full_shard", async_save=True)  # model.safetensors: default
        save_file(trained(straight), out / f"straight-{rank}.safetensors")
        llama = train(hf_model(), run_args(out / "llama", fsdp="full_shard", max_steps=2, save_steps=2), rows())
        save_file(trained(llama), out / f"llama-{rank}.safetensors")
        resumed = _resume_copy(out, "resumed-2", rank, save_consolidated_model=False)  # its checkpoint-8: shards only
        save_file(trained(resumed), out / f"resumed-2-{rank}.safetensors")
        save_file(trained(elastic_run(out / "ddp")), out / f"ddp-{rank}.safetensors")  # replicated: rank 0 saves
        grown = _resume_copy(out, "grown", rank, source="single")  # a one-process checkpoint onto 2 fully_shard ranks
        save_file(trained(grown), out / f"grown-{rank}.safetensors")
    else:
        with pytest.warns(UserWarning, match="per_device_train_batch_size 2 -> 1, gradient_accumulation_steps 1 -> 1"):
            result = _resume_copy(out, f"resumed-{world}", rank)
        save_file(trained(result), out / f"resumed-{world}-{rank}.safetensors")
        from trainfold.observe.observers import initial_extras
        from trainfold.trainer.train import default_optimizer

        optimizer = default_optimizer(tiny(), run_args(out).optimizer_settings(), 8)
        template = init_state(tiny(), optimizer, extras=initial_extras())
        loaded = ckpt.load(out / "straight" / "checkpoint-8", like=shard(template, mesh))
        assert sc.is_sharded(loaded)
        save_file(local_slabs(gathered(loaded)), out / f"loaded-{world}-{rank}.safetensors")
    dist.barrier()
    dist.destroy_process_group()


def _failing_async_save(saver, state, out: Path, rank: int) -> None:
    """Rank 1 fails while writing its shard: no rank sees a checkpoint, both raise naming rank 1."""
    import torch.distributed as dist

    seen = []

    def hook(label):
        if label.startswith("sharded:wrote:shard-"):
            seen.append(sorted(p.name for p in out.iterdir()) if out.exists() else [])
            if rank == 1:
                raise OSError(5, "injected write failure")

    faults.fault_hook = hook
    try:
        saver.save(state, out / f"checkpoint-{STEP}")
        try:
            saver.wait()
            error = "none"
        except (OSError, ckpt.CheckpointError) as e:
            error = str(e)
    finally:
        faults.fault_hook = None
    dist.barrier()
    (out.parent / f"faulty-{rank}.json").write_text(
        json.dumps({"error": error, "seen": seen, "after": sorted(p.name for p in out.iterdir())})
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    save_file(trained(elastic_run(out / "single", gradient_accumulation_steps=2)), out / "single.safetensors")
    for phase, n in (("save", 2), ("load", 4)):
        torchrun_ok(__file__, phase, out, nproc=n)
    return out


# -- the tests -------------------------------------------------------------------------------------


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_two_rank_checkpoint_reloads_bitwise_on_two_ranks(ranks):
    for r in range(2):
        saved, loaded = load_file(ranks / f"saved-2-{r}.safetensors"), load_file(ranks / f"loaded-2-{r}.safetensors")
        assert saved.keys() == loaded.keys()
        for k in saved:
            assert torch.equal(saved[k], loaded[k]), k


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_two_rank_checkpoint_reshards_onto_four_ranks(ranks):
    saved = load_file(ranks / "straight-0.safetensors")  # the state at step 8, of the sharded train run
    for r in range(4):
        loaded = load_file(ranks / f"loaded-4-{r}.safetensors")  # its checkpoint-8 on 4 ranks, gathered
        for k in [k for k in saved if k not in ("losses", "grad_norms")]:  # logged, not in a checkpoint
            assert torch.equal(saved[k], loaded[k]), k


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_two_rank_checkpoint_loads_in_one_process(ranks):
    like = init_state(hf_model(), adamw(1e-3))
    loaded = ckpt.load(ranks / "sync" / f"checkpoint-{STEP}", like=like)
    expected = flatten(full_state(hf_model()))
    got = flatten(loaded)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    weights = ckpt.load_weights(ranks / "async" / f"checkpoint-{STEP}", like=like)
    assert all(torch.equal(weights.params[k], full_state(hf_model()).params[k]) for k in like.params)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_the_consolidated_model_loads_with_from_pretrained(ranks):
    transformers = pytest.importorskip("transformers")
    path = ranks / "sync" / f"checkpoint-{STEP}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.LlamaForCausalLM.from_pretrained(path)
    expected = full_state(hf_model()).params
    for name, p in loaded.named_parameters():
        assert torch.equal(p, expected[name]), name


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_sharded_train_run_loads_with_from_pretrained_by_default(ranks):
    transformers = pytest.importorskip("transformers")
    path = ranks / "llama" / "checkpoint-2"  # train(fsdp="full_shard") of a Llama, save_consolidated_model untouched
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    trained_params = load_file(ranks / "llama-0.safetensors")
    names = [name for name, _ in loaded.named_parameters()]
    assert sorted(f"params.{n}" for n in names) == sorted(k for k in trained_params if k.startswith("params."))
    assert not torch.equal(trained_params["params.lm_head.weight"], hf_model().lm_head.weight)  # it trained
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained_params[f"params.{name}"]), name


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_save_consolidated_model_false_leaves_the_full_model_out(ranks):
    path = ranks / "resumed-2" / "checkpoint-8"
    names = sorted(p.name for p in path.iterdir())
    assert "model.safetensors" not in names and ckpt.SHARD_DIR in names and ckpt.is_complete(path)
    like = init_state(tiny(), adamw(1e-3))  # the shards alone give the weights
    weights = ckpt.load_weights(path, like=like)
    straight = load_file(ranks / "straight-0.safetensors")
    assert all(torch.equal(v, straight[f"params.{k}"]) for k, v in weights.params.items())


def _is_pickle(data: bytes) -> bool:
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_sharded_checkpoints_are_safetensors_and_json_only(ranks):
    for path in (
        ranks / "sync" / f"checkpoint-{STEP}",
        ranks / "async" / f"checkpoint-{STEP}",
        ranks / "straight" / "checkpoint-8",
    ):
        names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
        assert shard_file(0, 2) in names and shard_file(1, 2) in names
        for p in (p for p in path.rglob("*") if p.is_file()):
            if p.suffix == ".json":
                json.loads(p.read_text())
            else:
                assert p.suffix == ".safetensors", p
                with safetensors.safe_open(str(p), framework="pt") as f:
                    assert list(f.keys())
            head = p.read_bytes()[:2]
            assert not (p.suffix == ".json" and _is_pickle(head)), p
        assert ".metadata" not in names and ckpt.is_complete(path)
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # each rank's slab, in its own file

    md = HuggingFaceStorageReader(str(ranks / "sync" / f"checkpoint-{STEP}" / ckpt.SHARD_DIR)).read_metadata()
    chunks = sorted(
        (f"{ckpt.SHARD_DIR}/{Path(info.relative_path).name}", list(index.offset), list(info.shape))
        for index, info in md.storage_data.items()
        if index.fqn == "params.model.embed_tokens.weight"
    )
    assert chunks == [(shard_file(0, 2), [0, 0], [24, 16]), (shard_file(1, 2), [24, 0], [24, 16])]


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_tensor_with_fewer_rows_than_ranks_round_trips_with_an_empty_shard(ranks):
    for r in range(2):
        got = load_file(ranks / f"uneven-{r}.st")
        assert got["weight"].tolist() == [[1.0, 1.0, 1.0]] and got["bias"].tolist() == [2.0]
        assert got["params.bias"].numel() == (1 if r == 0 else 0)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_failing_rank_leaves_no_checkpoint_and_both_ranks_name_it(ranks):
    for r in range(2):
        report = json.loads((ranks / f"faulty-{r}.json").read_text())
        assert "rank 1" in report["error"] and "injected write failure" in report["error"], report
        assert all(not name.startswith("checkpoint-") for seen in report["seen"] for name in seen)
        assert report["after"] == []  # the temporary directory is gone too


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    """Bitwise where ``tol`` is 0; else ``got`` resumed the run on another number of ranks or accumulation steps.

    Then steps 1-4 are the same (the checkpoint-4 state and the log it carries: bitwise) and steps 5-8 sum the same
    4 rows' token terms in another order. The runs use clipped SGD + momentum (``run_args``), so
    ``causal_lm_run_bounds`` over steps 5-8 bounds the params element by element (tests/tolerance.py: sizes measured
    at the initial params over all rows, each over the fewest labels 4 rows can have, clip coefficients from the
    reference's logged grad norms, lr <= 1e-2). A momentum is at most its params' bound over lr (the params move by
    lr times each momentum). Step 5's loss is taken at the same params: its token terms (positive) reordered, at
    most the 4 longest rows' positions; steps 6-8 within the bound's ``loss_atol``.
    """
    from tolerance import assert_within, causal_lm_run_bounds, reordered

    assert got.keys() == want.keys()
    if tol == 0:
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        return
    history = [{"grad_norm": n} for n in want["grad_norms"][4:].tolist()]
    bound, rtol, loss_atol = causal_lm_run_bounds(tiny(), rows(), 4, history, 1e-2, 0.9, max_norm=1.0)
    terms = sum(sorted(len(r["input_ids"]) for r in rows())[-4:])
    for k, v in want.items():
        name = max((n for n in bound if k.endswith("." + n)), key=len, default=None)  # norm.weight, blocks.0.norm...
        if k == "losses":
            assert len(v) == 8 and torch.equal(got[k][:4], v[:4])
            assert got[k][4].item() == pytest.approx(v[4].item(), abs=reordered(terms, v[4].item()), rel=0)
            for a, b in zip(got[k][5:].tolist(), v[5:].tolist()):
                assert a == pytest.approx(b, abs=loss_atol(b), rel=0)
        elif k == "grad_norms":  # steps 5-8's are inputs of the bound
            assert len(v) == 8 and torch.equal(got[k][:4], v[:4])
        elif name is None:
            assert torch.equal(got[k], v), k  # counts
        else:
            assert_within(got[k], v, bound[name] if k.startswith("params.") else bound[name] / 1e-2, rtol, k)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_an_elastic_resume_on_the_same_two_ranks_is_bitwise(ranks):
    straight = load_file(ranks / "straight-0.safetensors")
    _close(load_file(ranks / "resumed-2-0.safetensors"), straight, tol=0)
    _close(load_file(ranks / "straight-1.safetensors"), straight, tol=0)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_two_rank_run_resumes_on_four_ranks_within_fp32_rounding(ranks):
    straight = load_file(ranks / "straight-0.safetensors")
    for r in range(4):
        _close(load_file(ranks / f"resumed-4-{r}.safetensors"), straight, tol=1e-6)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_one_process_run_resumes_on_two_fully_shard_ranks(ranks):
    single = load_file(ranks / "single.safetensors")
    for r in range(2):
        _close(load_file(ranks / f"grown-{r}.safetensors"), single, tol=1e-6)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
@pytest.mark.parametrize("run", ["straight", "ddp"])
def test_a_two_rank_run_resumes_in_one_process_with_accumulation(ranks, tmp_path, run):
    import shutil

    shutil.copytree(ranks / run, tmp_path / "out")
    shutil.rmtree(tmp_path / "out" / "checkpoint-8")  # resume_from_checkpoint=True takes checkpoint-4
    with pytest.warns(UserWarning, match="per_device_train_batch_size 2 -> 2, gradient_accumulation_steps 1 -> 2"):
        result = elastic_run(tmp_path / "out", resume=True)
    steps = [h["step"] for h in result.log_history if "loss" in h and "train_loss" not in h]
    assert result.global_step == 8 and steps == list(range(1, 9))  # 1-4 from the log of the run, 5-8 here
    got, straight = trained(result), load_file(ranks / f"{run}-0.safetensors")
    _close(got, straight, tol=1e-6)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_one_process_resume_of_a_two_rank_run_that_stopped_before_its_first_step_resumes_again(ranks, tmp_path):
    import shutil

    from trainfold import train

    out = tmp_path / "out"
    shutil.copytree(ranks / "ddp", out)
    shutil.rmtree(out / "checkpoint-8")  # resume_from_checkpoint=True takes checkpoint-4

    def stopped(batch):
        raise KeyboardInterrupt("stopped before the first step")

    with pytest.warns(UserWarning, match="gradient_accumulation_steps 1 -> 2"), pytest.raises(KeyboardInterrupt):
        train(tiny(), run_args(out), rows(), data_collator=stopped, resume_from_checkpoint=True)
    with pytest.warns(UserWarning, match="gradient_accumulation_steps 1 -> 2"):  # the same command: resumed
        result = elastic_run(out, resume=True)
    assert result.global_step == 8
    _close(trained(result), load_file(ranks / "ddp-0.safetensors"), tol=1e-6)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_sharded_train_run_writes_sharded_checkpoints_with_the_full_model(ranks):
    for step in (4, 8):
        path = ranks / "straight" / f"checkpoint-{step}"
        names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
        assert names == [
            "config.json",
            "model.safetensors",
            shard_file(0, 2),
            shard_file(1, 2),
            "trainfold.json",
        ]
        assert ckpt.is_complete(path) and ckpt.read_metadata(path)["step"] == step
    assert not [p for p in (ranks / "straight").iterdir() if p.name.startswith(".checkpoint")]
    like = init_state(tiny(), adamw(1e-3))
    weights = ckpt.load_weights(ranks / "straight" / "checkpoint-8", like=like)
    full = load_file(ranks / "straight" / "checkpoint-8" / "model.safetensors")
    straight = load_file(ranks / "straight-0.safetensors")
    for k, v in weights.params.items():
        assert torch.equal(v, straight[f"params.{k}"]) and torch.equal(full[k], v), k


@pytest.mark.slow
def test_sigterm_to_one_rank_of_a_sharded_run_ends_both_with_one_sharded_jit_checkpoint(tmp_path):
    from resume_fixture import endless_cli_config, sigterm_rank_one_of_cli_ranks

    out = tmp_path / "out"
    config = endless_cli_config(tmp_path, out)
    config.write_text(config.read_text().replace("[args]\n", '[args]\nfsdp = "full_shard"\nasync_save = true\n'))
    results = sigterm_rank_one_of_cli_ranks(config, out)
    for _, err, code in results:
        assert code == 143, err[-3000:]
    step = json.loads(results[0][0].strip().splitlines()[-1])["global_step"]
    found = sorted(out.glob("checkpoint-*"))
    assert [p.name for p in found] == [f"checkpoint-{step}"] and ckpt.is_complete(found[0])
    meta = ckpt.read_metadata(found[0])
    assert meta["jit"] and shard_file(0, 2) in meta["files"] and shard_file(1, 2) in meta["files"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_sigterm_on_a_save_step_of_a_fresh_sharded_run_ends_every_rank_and_resumes_bitwise(tmp_path):
    """Defect D1: each rank drew its own run id, so rank 0 saw "already saved" while rank 1 began the JIT save."""
    from resume_fixture import endless_cli_config, sigterm_rank_one_of_cli_ranks
    from torchrun import torchrun

    def configured(out: Path) -> Path:
        folder = out.parent / f"{out.name}-config"
        folder.mkdir()
        config = endless_cli_config(folder, out)
        sharded_saves = '[args]\nfsdp = "full_shard"\nsave_steps = 1\nlr_scheduler_type = "constant"\n'
        config.write_text(config.read_text().replace("[args]\n", sharded_saves).replace('save_strategy = "no"', ""))
        return config

    def ranks(config: Path, *cli: str) -> None:
        done = torchrun(
            ROOT / "src" / "trainfold" / "cli" / "__main__.py", "train", "--config", config, *cli, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]

    cut = tmp_path / "cut"
    config = configured(cut)
    for _, err, code in sigterm_rank_one_of_cli_ranks(config, cut):  # every step saves: SIGTERM lands on a save
        assert code == 143, err[-3000:]
    stopped = max(int(p.name.split("-")[1]) for p in cut.glob("checkpoint-*"))
    end = f"args.max_steps={stopped + 2}"
    ranks(config, "--resume", "--set", end)
    straight = tmp_path / "straight"
    ranks(configured(straight), "--set", end)
    for shard in (shard_file(0, 2), shard_file(1, 2)):  # each rank's shards of the params and optimizer state
        resumed = load_file(cut / f"checkpoint-{stopped + 2}" / shard)
        expected = load_file(straight / f"checkpoint-{stopped + 2}" / shard)
        trained = [k for k in expected if k.startswith(("params.", "opt_state."))]
        assert trained and resumed.keys() == expected.keys()
        assert all(torch.equal(resumed[k], expected[k]) for k in trained), shard


# -- one process -----------------------------------------------------------------------------------


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_corruption_of_a_shard_is_detected_by_name(ranks, tmp_path):
    import shutil

    path = tmp_path / f"checkpoint-{STEP}"
    shutil.copytree(ranks / "sync" / f"checkpoint-{STEP}", path)
    shard = path / shard_file(1, 2)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    like = init_state(hf_model(), adamw(1e-3))
    with pytest.raises(
        ckpt.CheckpointError, match=r"shard-00002-model-00001-of-00001.safetensors is corrupted: its xxh3_64"
    ):
        ckpt.load(path, like=like)
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(ckpt.CheckpointError, match=r"shard-00002-model-00001-of-00001.safetensors is truncated"):
        ckpt.load(path, like=like)
    assert not ckpt.is_complete(path)
    shutil.copy(ranks / "sync" / f"checkpoint-{STEP}" / shard_file(1, 2), shard)  # intact again
    shutil.copy(path / shard_file(0, 2), path / ckpt.SHARD_DIR / "extra.safetensors")  # DCP's reader would read it
    with pytest.raises(ckpt.CheckpointError, match=r"sharded holds .*extra.safetensors.*, but .* lists"):
        ckpt.load(path, like=like)


@pytest.mark.slow  # the torchrun launches of the ranks fixture
def test_a_sharded_checkpoint_refuses_another_model_by_name(ranks):
    import transformers

    path = ranks / "sync" / f"checkpoint-{STEP}"
    with pytest.raises(KeyError, match=r"sharded does not fit the template .* missing \['opt_state.mu.blocks"):
        ckpt.load(path, like=init_state(tiny(), adamw(1e-3)))
    config = hf_model().config
    config.intermediate_size = 32
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight: loaded \(16, 24\) torch.float32, expected \(16, 32\)"):
        ckpt.load(path, like=init_state(transformers.LlamaForCausalLM(config), adamw(1e-3)))


def test_an_async_save_is_invisible_until_complete(tmp_path):
    gate, reached = threading.Event(), threading.Event()

    def hook(label):
        if label == "save:wrote:sidecar":
            reached.set()
            gate.wait(30)

    state = init_state(torch.nn.Linear(3, 2), adamw(1e-3))
    saver = sc.Saver(async_save=True)
    faults.fault_hook = hook
    try:
        path = saver.save(state, ckpt.checkpoint_path(tmp_path, 0))
        assert reached.wait(30)  # the writer thread is at its last step before the rename
        assert not path.exists() and ckpt.list_checkpoints(tmp_path) == []
        gate.set()
        assert saver.wait() == path and ckpt.is_complete(path)
    finally:
        faults.fault_hook = None


def test_an_async_save_copies_the_state_before_the_step_changes_it(tmp_path):
    state = init_state(torch.nn.Linear(3, 2), adamw(1e-3))
    expected = state.params["weight"].clone()
    saver = sc.Saver(async_save=True)
    path = saver.save(state, tmp_path / "c")
    state.params["weight"].add_(1.0)  # a donated step updates in place
    saver.wait()
    assert torch.equal(ckpt.load(path, like=state).params["weight"], expected)


def test_a_process_killed_mid_async_save_leaves_no_checkpoint(tmp_path):
    code = f"""
import os, torch
from trainfold import ckpt
from trainfold.ckpt import faults, sharded as sc
from trainfold.optim import sgd
from trainfold.core.state import init_state
state = init_state(torch.nn.Linear(3, 2), sgd(0.1))
ckpt.save(state, ckpt.checkpoint_path({str(tmp_path)!r}, 0))
faults.fault_hook = lambda label: os._exit(3) if label == "save:wrote:sidecar" else None
sc.Saver(async_save=True).save(state, ckpt.checkpoint_path({str(tmp_path)!r}, 1))
import time; time.sleep(30)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-0"]
    assert not (tmp_path / "checkpoint-1").exists()


def test_a_failed_async_save_raises_at_the_next_wait(tmp_path):
    saver = sc.Saver(async_save=True)
    state = init_state(torch.nn.Linear(3, 2), adamw(1e-3))
    saver.save(state, tmp_path / "c", metadata={"bad": object()})
    with pytest.raises(TypeError, match="save metadata must be JSON-serialisable"):
        saver.wait()
    assert saver.wait() is None  # raised once


def test_async_save_in_train_writes_the_same_checkpoints_and_rotates_after_each_is_complete(tmp_path):
    runs = {}
    for mode in (False, True):
        out = tmp_path / f"async-{mode}"
        result = elastic_run(out, max_steps=6, save_steps=2, save_total_limit=1, async_save=mode)
        assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-6"]
        assert result.last_checkpoint == out / "checkpoint-6" and not [p for p in out.iterdir() if "tmp" in p.name]
        runs[mode] = (trained(result), load_file(out / "checkpoint-6" / ckpt.STATE_FILE))
    _close(runs[True][0], runs[False][0], tol=0)
    _close(runs[True][1], runs[False][1], tol=0)


# -- the elastic rule ------------------------------------------------------------------------------


def test_the_split_keeps_the_per_device_batch_when_it_can_and_never_grows_it():
    from trainfold.data.global_batch import split_global_batch

    assert split_global_batch(16, world_size=2, per_device=4) == (4, 2)
    assert split_global_batch(16, world_size=8, per_device=4) == (2, 1)
    assert split_global_batch(18, world_size=2, per_device=4) == (3, 3)  # 9 per rank: 3 divides it, 4 does not
    assert split_global_batch(14, world_size=2, per_device=4) == (1, 7)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 12])
def test_every_split_makes_the_global_batch(world):
    from trainfold.data.global_batch import split_global_batch

    for per_device in range(1, 13):
        size, steps = split_global_batch(12, world_size=world, per_device=per_device)
        assert size * steps * world == 12 and size <= per_device


def test_check_compatible_takes_another_split_of_the_same_global_batch_and_names_a_different_one():
    from trainfold.ckpt.policy import check_compatible
    from trainfold.ckpt.run_identity import RunSettings

    def settings(world_size, **over):
        return RunSettings.of(run_args(Path("x"), **over), world_size=world_size)

    saved = settings(2).values  # 2 ranks x batch 2
    check_compatible(saved, settings(4, per_device_train_batch_size=1))
    with pytest.raises(
        ValueError, match=r"with different settings: per_device_train_batch_size: saved 2, now 1; resume"
    ):
        check_compatible(saved, settings(2, per_device_train_batch_size=1))


def test_a_resume_on_ranks_that_cannot_keep_the_global_batch_is_refused_by_name(tmp_path):
    from trainfold.trainer.planning import elastic_args

    saved = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "world_size": 2, "learning_rate": 1e-2}
    path = ckpt.save(init_state(torch.nn.Linear(2, 1), adamw(1e-3)), tmp_path / "checkpoint-0", settings=saved)
    args = run_args(tmp_path)
    with pytest.raises(ValueError, match=r"global batch of 4 samples per step cannot be split evenly over 3 ranks"):
        elastic_args(args, str(path), 3)
    assert elastic_args(args, str(path), 2) is args and elastic_args(args, None, 3) is args
    with pytest.warns(UserWarning, match=r"resuming a run of 2 ranks on 1: .*gradient_accumulation_steps 1 -> 2"):
        assert elastic_args(args, str(path), 1).gradient_accumulation_steps == 2
    other = args.replace(learning_rate=0.5)  # another run: left to claim, which names the differences
    assert elastic_args(other, str(path), 1) is other


def test_the_elastic_split_comes_from_the_checkpoint_not_from_the_run_file_a_failed_start_rewrote(tmp_path):
    from trainfold.ckpt import run_dir
    from trainfold.ckpt.run_identity import RunSettings
    from trainfold.trainer.planning import elastic_args

    two = run_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    saved = {**two.to_dict(), "world_size": 2}  # the checkpoint of a 2-rank run: global batch 4
    state = init_state(torch.nn.Linear(2, 1), adamw(1e-3))
    ckpt.save(state, tmp_path / "checkpoint-0", settings=saved, run={"id": "a", "fingerprint": "f"})
    with pytest.warns(UserWarning, match=r"resuming a run of 2 ranks on 1"):
        one = elastic_args(two, True, 1)
    assert one.gradient_accumulation_steps == 2
    # a 1-process start that stopped before its first step has rewritten the run file with its own split
    run_dir._write_run_file(tmp_path, run_dir.RunIdentity("b", "f"), RunSettings.of(one, world_size=1))
    for _ in range(2):  # the same 1-process command, again and again: still the checkpoint's global batch
        with pytest.warns(UserWarning, match=r"resuming a run of 2 ranks on 1"):
            assert elastic_args(two, True, 1).gradient_accumulation_steps == 2


def test_the_elastic_split_applies_again_to_a_checkpoint_its_own_resume_wrote_on_the_same_world(tmp_path):
    """Issue 44.7: 2 ranks x batch 2 x GA 2 resumed on 1 process (GA 4) writes checkpoint-8 with world_size 1 and GA 4;
    the same 1-process command (GA 2) resumes it again with GA 4, on the world size the checkpoint was written on."""
    from trainfold.core.state import scalar
    from trainfold.trainer.planning import elastic_args

    command = run_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    state = init_state(torch.nn.Linear(2, 1), adamw(1e-3))
    ckpt.save(
        attrs.evolve(state, step=scalar(6)), tmp_path / "checkpoint-6", settings={**command.to_dict(), "world_size": 2}
    )
    with pytest.warns(UserWarning, match=r"resuming a run of 2 ranks on 1: .*gradient_accumulation_steps 2 -> 4"):
        first = elastic_args(command, True, 1)
    ckpt.save(
        attrs.evolve(state, step=scalar(8)), tmp_path / "checkpoint-8", settings={**first.to_dict(), "world_size": 1}
    )
    for resume in (True, str(tmp_path / "checkpoint-8")):
        with pytest.warns(UserWarning, match=r"resuming a run of 1 ranks on 1: .*gradient_accumulation_steps 2 -> 4"):
            assert elastic_args(command, resume, 1).gradient_accumulation_steps == 4
        assert elastic_args(command, resume, 2) is command  # the command's own split: its global batch of 8


def test_the_run_fingerprint_sees_the_global_batch_not_its_split():
    from trainfold.ckpt.run_identity import RunSettings, settings_fingerprint

    def fp(world_size, **changes):
        return settings_fingerprint(RunSettings.of(run_args(Path("x"), **changes), world_size=world_size))

    assert fp(1, gradient_accumulation_steps=2) == fp(2)
    assert fp(1) != fp(2)
    assert fp(2, async_save=True, save_consolidated_model=True) == fp(2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(sys.argv[1], Path(sys.argv[2]))
