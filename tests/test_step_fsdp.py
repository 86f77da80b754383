"""A model the user wrapped with FSDP2 ``fully_shard`` trains through ``make_step`` on a lent, donated state.

The state's params are the module's own DTensor shards; FSDP gathers and reduce-scatters them
around the module's forward and backward. 2 gloo ranks (each half of the step's micro-batches)
must match one process on all of them, to the summation order (SGD + momentum: within 1e-6).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchrun import torchrun_ok

from trainfold import init_state, make_step, sgd
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig

WORLD, ACCUMULATION, STEPS = 2, 2, 3


def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyLMConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_len=8))


def micro_batches(step: int, rank: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for j in range(ACCUMULATION):
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + j)
        ids = torch.randint(0, 64, (3, 8), generator=g)
        labels = ids.clone()
        labels[torch.rand(3, 8, generator=g) < 0.3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _worker(out: Path, form: str) -> None:
    """Step a hand-wrapped fully_shard TinyLM on this rank's micro-batches; ``form``: ``"collective"`` passes
    ``collective=`` to ``make_step``, ``"alone"`` does not (docs/distributed.md's form: the mesh's group counts)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from trainfold.distributed.distributed import collective_from_env

    with collective_from_env() as c:
        net = model()
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        opt = sgd(0.1, momentum=0.9)
        step = make_step(net, causal_lm, opt, **({"collective": c} if form == "collective" else {}))
        state = init_state(net, opt, copy=False)
        for i in range(STEPS):
            state = step(state, micro_batches(i, c.rank), donate=True)
        assert isinstance(net, FSDPModule) and all(state.params[k] is p for k, p in net.named_parameters())
        full = {k: v.full_tensor() for k, v in state.params.items()}
        momentum = {f"momentum.{k}": v.full_tensor() for k, v in state.opt_state.momentum.items()}
        if c.rank == 0:
            save_file({**full, **momentum}, out / f"fsdp-{form}.safetensors")
            (out / f"loss-{form}.txt").write_text(repr(float(state.metrics["loss"])))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["collective", "alone"])
def test_a_user_wrapped_fully_shard_model_on_two_ranks_matches_one_process(tmp_path, form):
    """Issue 44.1 (``alone``): without ``collective=`` the step counted each rank's items alone while FSDP summed
    the ranks' gradients: gradients x world size (params 0.18 off after 5 SGD steps)."""
    torchrun_ok(__file__, tmp_path, form, nproc=WORLD)
    two = load_file(tmp_path / f"fsdp-{form}.safetensors")
    net, opt = model(), sgd(0.1, momentum=0.9)
    step = make_step(net, causal_lm, opt)
    state = init_state(net, opt)
    for i in range(STEPS):
        state = step(state, [mb for r in range(WORLD) for mb in micro_batches(i, r)])
    for k, v in state.params.items():
        torch.testing.assert_close(two[k], v, rtol=0.0, atol=1e-6, msg=k)
    for k, v in state.opt_state.momentum.items():
        torch.testing.assert_close(two[f"momentum.{k}"], v, rtol=0.0, atol=1e-6, msg=k)
    loss = float((tmp_path / f"loss-{form}.txt").read_text())
    assert loss == pytest.approx(float(state.metrics["loss"]), abs=1e-6)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_fully_shard_model_steps_bitwise_as_the_unwrapped_module_on_one_rank(one_rank):
    from torch.distributed.fsdp import fully_shard

    from trainfold import adamw, chain, clip_by_global_norm

    opt = chain(clip_by_global_norm(0.5), adamw(1e-2, weight_decay=0.1))
    wrapped, plain = model(), model()
    for block in wrapped.blocks:
        fully_shard(block, mesh=one_rank)
    fully_shard(wrapped, mesh=one_rank)
    lent_step, pure_step = make_step(wrapped, causal_lm, opt), make_step(plain, causal_lm, opt)
    lent, pure = init_state(wrapped, opt, copy=False), init_state(plain, opt)
    for i in range(STEPS):
        lent, pure = lent_step(lent, micro_batches(i, 0), donate=True), pure_step(pure, micro_batches(i, 0))
    assert all(lent.params[k] is p for k, p in wrapped.named_parameters())
    for k, v in pure.params.items():
        assert torch.equal(lent.params[k].full_tensor(), v), k
    assert torch.equal(lent.metrics["grad_norm"], pure.metrics["grad_norm"])


def test_a_forward_without_backward_between_steps_leaves_the_state_lent(one_rank):
    """The root of a fully_shard model keeps its params gathered after a forward (torch's default for the root):
    the step puts it back on the shards the lent state holds, and steps it as if nothing had run."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    opt, nets = sgd(0.1, momentum=0.9), [model(), model()]
    for net in nets:
        for block in net.blocks:
            fully_shard(block, mesh=one_rank)
        fully_shard(net, mesh=one_rank)
    steps = [make_step(net, causal_lm, opt) for net in nets]
    states = [init_state(net, opt, copy=False) for net in nets]
    states = [step(s, micro_batches(0, 0), donate=True) for step, s in zip(steps, states)]
    with torch.no_grad():
        nets[0](input_ids=micro_batches(1, 0)[0]["input_ids"])  # evaluation in the user's own loop
    assert not isinstance(nets[0].tok.weight, DTensor)  # the root holds its gathered params now
    states = [step(s, micro_batches(1, 0), donate=True) for step, s in zip(steps, states)]
    assert all(states[0].params[k] is p for k, p in nets[0].named_parameters())
    for k, v in states[1].params.items():
        assert torch.equal(states[0].params[k].full_tensor(), v.full_tensor()), k


def test_a_user_wrapped_distributed_data_parallel_module_is_refused_with_the_fix(one_rank):
    """Issue 44.1: DDP averages the ranks' gradients, the step divides by the items of every rank (or its own)."""
    from torch.nn.parallel import DistributedDataParallel

    from trainfold import TrainingArguments, train

    ddp = DistributedDataParallel(model())
    with pytest.raises(
        TypeError, match=r"wrapped with DistributedDataParallel.*pass the module it wraps \(ddp.module\)"
    ):
        make_step(ddp, causal_lm, sgd(0.1))
    args = TrainingArguments(output_dir="unused", max_steps=1, report_to="none", disable_tqdm=True)
    with pytest.raises(TypeError, match=r"DistributedDataParallel"):
        train(ddp, args, [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 4)


def test_a_fully_shard_model_needs_a_lent_donated_state(one_rank):
    from torch.distributed.fsdp import fully_shard

    wrapped, opt = model(), sgd(0.1)
    fully_shard(wrapped, mesh=one_rank)
    step = make_step(wrapped, causal_lm, opt)
    with pytest.raises(
        TypeError, match=r"wrapped with fully_shard \(FSDP2\).* init_state\(model, optimizer, copy=False"
    ):
        step(init_state(wrapped, opt), micro_batches(0, 0))
    with pytest.raises(TypeError, match=r"lent, donated state"):
        step(init_state(wrapped, opt, copy=False), micro_batches(0, 0))


def test_train_takes_a_user_wrapped_fully_shard_module_and_trains_it_as_the_unwrapped_one(one_rank, tmp_path):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from trainfold import TrainingArguments, train

    wrapped, plain = model(), model()
    for block in wrapped.blocks:
        fully_shard(block, mesh=one_rank)
    fully_shard(wrapped, mesh=one_rank)
    rows = [{"input_ids": [1, 2, 3, i], "labels": [1, 2, 3, i]} for i in range(8)]

    def args(name: str) -> TrainingArguments:
        return TrainingArguments(
            output_dir=str(tmp_path / name),
            max_steps=2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            learning_rate=1e-2,
        )

    sharded, alone = train(wrapped, args("wrapped"), rows), train(plain, args("plain"), rows)
    assert isinstance(wrapped, FSDPModule) and all(sharded.state.params[k] is p for k, p in wrapped.named_parameters())
    for k, p in plain.named_parameters():
        assert torch.equal(dict(wrapped.named_parameters())[k].full_tensor(), p), k
    assert [h["loss"] for h in sharded.log_history[:-1]] == [h["loss"] for h in alone.log_history[:-1]]


@pytest.mark.parametrize("reshard", [True, False])
def test_full_shard_options_reach_fully_shard(one_rank, reshard):
    from torch.distributed.tensor import DTensor

    from trainfold.step.fsdp import FullShard, fully_shard_model

    net = fully_shard_model(model(), one_rank, FullShard(reshard_after_forward=reshard, param_dtype=torch.bfloat16))
    seen = []
    net.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).dtype))
    ids = torch.randint(0, 64, (2, 8))
    net(input_ids=ids).sum()  # a forward that will be followed by a backward (autograd on)
    assert seen == [torch.bfloat16]  # MixedPrecisionPolicy(param_dtype=bf16): the gathered params are bf16
    assert isinstance(next(net.blocks[0].parameters()), DTensor) == reshard  # resharded after forward, or kept
    root_own = [p for n, p in net.named_parameters() if not n.startswith("blocks.")]
    assert root_own and not any(isinstance(p, DTensor) for p in root_own)  # the root keeps its own for backward
    if reshard:  # the shards (the state's params) stay fp32
        assert all(p.dtype == torch.float32 for p in net.blocks[0].parameters())
    with pytest.raises(ValueError, match=r"this run is on the CPU already \(a 'cpu' mesh\): drop 'offload'"):
        fully_shard_model(model(), one_rank, FullShard(offload=True))


def test_an_async_save_reads_a_fully_shard_module_on_the_callers_thread_only(one_rank, tmp_path):
    """FSDP2's state_dict pre-hook reshards the module: from the writer thread it would race the next forward."""
    import threading

    from trainfold import ckpt
    from trainfold.ckpt.sharded import Saver
    from trainfold.step.fsdp import fully_shard_model

    net = fully_shard_model(model(), one_rank)
    threads = []
    net.register_state_dict_pre_hook(lambda *args, **kwargs: threads.append(threading.current_thread()))
    opt = sgd(0.1)
    state = make_step(net, causal_lm, opt)(init_state(net, opt, copy=False), micro_batches(0, 0), donate=True)
    saver = Saver(async_save=True, consolidate=True)
    path = saver.save(state, tmp_path / "checkpoint-1", model=net)
    assert saver.wait() == path and ckpt.is_complete(path) and (path / "model.safetensors").exists()
    assert threads and all(t is threading.main_thread() for t in threads)
    full = load_file(path / "model.safetensors")
    assert all(torch.equal(full[k], v.full_tensor()) for k, v in state.params.items())


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2])
