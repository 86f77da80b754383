"""GRPO on a rollout engine: the local engine at staleness 0 is the engine-less run bitwise; with
``max_staleness >= 1`` the next blocks are submitted before the current one trains, each with the weights of
version ``max(0, t - max_staleness)``, corrected by TRL's importance-sampling ratio; runs resume bitwise with
generations in flight (local and process engines)."""

from __future__ import annotations

import os

import attrs
import pytest
import torch

from trainfold import init_state, loop, make_step, sgd
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.grpo import RolloutEngine
from trainfold.grpo.args import GRPOArguments
from trainfold.grpo.rollouts import PUBLISHED, BatchedEngine, Rollouts
from trainfold.grpo.run import BUFFER, Codec, GRPORun, grpo_stream, train
from trainfold.rollout import ProcessEngine
from trainfold.rollout import RolloutEngine as ProtocolItself

CFG = TinyLMConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_len=16)
CODEC = Codec(lambda s: [1 + int(c) for c in s], lambda ids: "".join(str(i % 10) for i in ids))
DATA = [{"prompt": str(d) + str(d + 1)} for d in range(8)]


def lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(CFG)


def digit_sum(prompts, completions, **_):
    return [sum(int(ch) for ch in c) / 10 for c in completions]


def args_of(out, **kw) -> GRPOArguments:
    base = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        learning_rate=5e-2,
        save_strategy="no",
        seed=3,
    )
    return GRPOArguments(**{**base, **kw})


def research_run(run, steps: int = 4):
    """Run ``run``'s stream with ``loop.run``; return the final state and the losses of each step."""
    losses: list[torch.Tensor] = []
    step = make_step(run.model, optimizer=sgd(0.05), objective=run.objective)
    hook = loop.every(1, lambda s, log: losses.append(s.metrics["loss"].clone()))
    state, _ = loop.run(
        step, init_state(run.model, sgd(0.05), seed=run.args.seed), run.stream(), stop=lambda s: int(s.step) >= steps,
        hooks=[hook],
    )  # fmt: skip
    return state, losses


def test_the_protocol_is_public_at_grpo():
    assert RolloutEngine is ProtocolItself
    assert isinstance(BatchedEngine(lm()), RolloutEngine)


def test_local_engine_at_staleness_0_is_the_run_without_an_engine_bitwise(tmp_path):
    args = args_of(tmp_path, gradient_accumulation_steps=2, steps_per_generation=4, beta=0.05)
    with_engine = grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC)
    assert isinstance(with_engine.rollouts, Rollouts) and with_engine.rollouts.plan.correction is None
    engineless = attrs.evolve(grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC), rollouts=None)  # main's path
    ours, our_losses = research_run(with_engine)
    theirs, their_losses = research_run(engineless)
    assert [float(x) for x in our_losses] == [float(x) for x in their_losses] and len(our_losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(our_losses, their_losses))
    assert not torch.equal(ours.params["tok.weight"], lm().tok.weight)
    for k in ours.params:
        assert torch.equal(ours.params[k], theirs.params[k]), k
    assert torch.equal(ours.extras[BUFFER].completion_ids, theirs.extras[BUFFER].completion_ids)
    assert with_engine.rollouts.engine.version == 2  # generations at steps 0 and 2, each with its step as version


class Recorder:
    """Record the run's order of events: each submit (generation key, version, step of the state) and step."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        real = Rollouts.submit

        def submit(r, state, key, prompt_ids, version):
            if key not in r._open:
                self.events.append(("submit", version, int(state.step)))
            return real(r, state, key, prompt_ids, version)

        monkeypatch.setattr(Rollouts, "submit", submit)


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_submits_ahead_with_the_version_the_schedule_names(tmp_path, monkeypatch, staleness):
    rec = Recorder(monkeypatch)
    args = args_of(tmp_path, max_staleness=staleness)
    run = grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC)
    versions = []
    real = GRPORun.generation

    def generation(self, state, epoch, number, indices):
        buffer, metrics = real(self, state, epoch, number, indices)
        if self.args.max_staleness:
            versions.append((int(state.step), buffer.versions.unique().tolist()))
            assert buffer.is_ratio is not None and buffer.old_logps is not None
        return buffer, metrics

    monkeypatch.setattr(GRPORun, "generation", generation)
    state, losses = research_run(run)
    # block t (one generation per step here) is generated with version max(0, t - staleness)
    assert versions == [(t, [max(0, t - staleness)]) for t in range(4)]
    # at step v the generation of step v + staleness is submitted, before step v trains
    submits = [e for e in rec.events if e[0] == "submit"]
    assert submits[: staleness + 1] == [("submit", 0, 0)] * (staleness + 1)
    assert submits[staleness + 1 :] == [("submit", v, v) for v in range(1, 4)]
    assert state.extras[PUBLISHED]["versions"].tolist() == [max(0, 4 - staleness + j) for j in range(staleness)]
    versions.clear()
    again, again_losses = research_run(grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC))
    assert all(torch.equal(a, b) for a, b in zip(losses, again_losses))  # a pure function of the schedule
    for k in state.params:
        assert torch.equal(state.params[k], again.params[k]), k
    sync, _ = research_run(grpo_stream(lm(), args_of(tmp_path), DATA, digit_sum, codec=CODEC))
    assert not torch.equal(sync.params["tok.weight"], state.params["tok.weight"])  # stale samples train otherwise


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_an_async_generation_logs_trls_sampling_metrics(tmp_path, mode):
    args = args_of(tmp_path, max_staleness=1, vllm_importance_sampling_mode=mode)
    state, _ = research_run(grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC), steps=3)
    buffer, m = state.extras[BUFFER], state.metrics
    mask = torch.arange(buffer.completion_ids.shape[1])[None, :] < buffer.completion_length[:, None]
    ratios = buffer.is_ratio[:, 0] if mode.startswith("sequence") else buffer.is_ratio[mask]
    assert torch.allclose(m["sampling/importance_sampling_ratio/mean"].float(), ratios.mean())
    assert torch.allclose(m["sampling/importance_sampling_ratio/min"].float(), ratios.min())
    assert 0 < float(m["sampling/sampling_logp_difference/max"])  # step 2 trains on version 1's samples
    assert float(m["sampling/sampling_logp_difference/mean"]) <= float(m["sampling/sampling_logp_difference/max"])


def test_the_loss_multiplies_the_policy_terms_by_trls_is_ratio():
    from trainfold.grpo.objective import grpo_objective

    objective = grpo_objective("grpo", beta=0.0)
    logps = torch.tensor([[-1.0, -2.0, -0.5]])
    mb = {"completion_mask": torch.tensor([[0, 1, 1, 1]]), "advantages": torch.tensor([1.0])}
    plain, _ = objective.loss_from_logps(logps, torch.zeros_like(logps), mb, torch.tensor(3))
    weighted, _ = objective.loss_from_logps(
        logps, torch.zeros_like(logps), {**mb, "importance_sampling_ratio": torch.tensor([[0.5, 0.5, 0.5]])},
        torch.tensor(3),
    )  # fmt: skip
    assert torch.allclose(weighted, plain * 0.5)


def _resume_case(tmp_path, engine: str, staleness: int, tag: str):
    args = args_of(tmp_path / f"{tag}-a", rollout_engine=engine, max_staleness=staleness, max_completion_length=3)
    straight = train(lm(), args, DATA, digit_sum, codec=CODEC)
    saving = args.replace(output_dir=str(tmp_path / f"{tag}-b"), save_strategy="steps", save_steps=1)
    first = train(lm(), saving, DATA, digit_sum, codec=CODEC, stop=lambda s: int(s.step) >= 2)
    assert first.status == "stopped" and first.global_step == 2
    resumed = train(lm(), saving, DATA, digit_sum, codec=CODEC, resume_from_checkpoint=True)
    assert resumed.global_step == 4
    losses = lambda r: [e["loss"] for e in r.log_history if "loss" in e]
    assert losses(resumed)[-2:] == losses(straight)[-2:]
    for k in straight.state.params:
        assert torch.equal(straight.state.params[k], resumed.state.params[k]), (engine, staleness, k)
    return straight


@pytest.mark.parametrize("staleness", [0, 1])
def test_stop_and_resume_with_generations_in_flight_is_bitwise_local(tmp_path, staleness):
    _resume_case(tmp_path, "local", staleness, "local")


def test_stop_and_resume_with_generations_in_flight_is_bitwise_process(tmp_path):
    for staleness in (0, 1):
        straight = _resume_case(tmp_path, "process", staleness, f"p{staleness}")
        assert not torch.equal(straight.state.params["tok.weight"], lm().tok.weight)


def test_process_engine_generates_in_another_process(tmp_path):
    run = grpo_stream(lm(), args_of(tmp_path, rollout_engine="process", max_staleness=1), DATA, digit_sum, codec=CODEC)
    try:
        research_run(run, steps=2)
        assert isinstance(run.rollouts.engine, ProcessEngine) and run.rollouts.engine.process.is_alive()
        assert run.rollouts.engine.version == 1
    finally:
        run.rollouts.close()


# -- preemption and faults -------------------------------------------------------------------------------


def test_sigterm_with_generations_in_flight_on_the_process_engine_resumes_bitwise(tmp_path):
    import os
    import signal

    calls = []

    def interrupting(prompts, completions, **_):
        calls.append(len(completions))
        if len(calls) == 2:  # while step 2 is made: generation of step 3 is in flight on the server
            os.kill(os.getpid(), signal.SIGTERM)
        return digit_sum(prompts, completions)

    args = args_of(tmp_path / "a", rollout_engine="process", max_staleness=1, max_completion_length=3)
    straight = train(lm(), args, DATA, digit_sum, codec=CODEC)
    jit = args.replace(output_dir=str(tmp_path / "b"), enable_jit_checkpoint=True)
    first = train(lm(), jit, DATA, interrupting, codec=CODEC)
    assert first.status == "preempted" and first.global_step == 2
    assert first.state.extras[PUBLISHED]["versions"].tolist() == [1]  # the weights the open generation needs
    resumed = train(lm(), jit, DATA, interrupting, codec=CODEC, resume_from_checkpoint=True)
    assert resumed.global_step == 4
    for k in straight.state.params:
        assert torch.equal(straight.state.params[k], resumed.state.params[k]), k


def _killing(run, at_call: int):
    import os
    import signal

    calls = []

    def reward(prompts, completions, **_):
        calls.append(1)
        if len(calls) == at_call:  # the generation of the next step is in flight on the server
            os.kill(run.rollouts.engine.process.pid, signal.SIGKILL)
            run.rollouts.engine.process.join()
        return digit_sum(prompts, completions)

    return reward


def test_a_dead_generation_process_is_restarted_and_regenerates_its_open_requests_bitwise(tmp_path):
    args = args_of(tmp_path, rollout_engine="process", max_staleness=1, max_completion_length=3)
    clean = grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC)
    try:
        straight, straight_losses = research_run(clean)
    finally:
        clean.rollouts.close()
    run = grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC)
    object.__setattr__(run, "reward_funcs", (_killing(run, at_call=2),))
    try:
        state, losses = research_run(run)
        assert run.rollouts.restarts == 1
    finally:
        run.rollouts.close()
    assert all(torch.equal(a, b) for a, b in zip(losses, straight_losses))
    for k in state.params:
        assert torch.equal(state.params[k], straight.params[k]), k


def test_a_generation_process_that_keeps_dying_stops_the_run_by_name(tmp_path, monkeypatch):
    from trainfold.grpo import rollouts
    from trainfold.rollout import EngineDied

    monkeypatch.setattr(rollouts, "MAX_RESTARTS", 0)
    args = args_of(tmp_path, rollout_engine="process", max_staleness=1, max_completion_length=3)
    run = grpo_stream(lm(), args, DATA, digit_sum, codec=CODEC)
    object.__setattr__(run, "reward_funcs", (_killing(run, at_call=2),))
    try:
        with pytest.raises(EngineDied, match=r"the 'process' rollout engine died 1 times, the last at step 2.*resume"):
            research_run(run)
    finally:
        run.rollouts.close()


def test_a_reward_function_that_raises_is_named_with_its_prompts(tmp_path):
    def broken(prompts, completions, **_):
        raise KeyError("answer")

    with pytest.raises(RuntimeError, match=r"reward function broken raised KeyError: 'answer'.*prompts '\d\d'"):
        train(lm(), args_of(tmp_path), DATA, broken, codec=CODEC)


_SCRIPT = """
import os, signal, sys, torch
sys.path.insert(0, "tests")
from test_grpo_async import CODEC, DATA, args_of, digit_sum, lm
from trainfold.grpo.run import train
out, engine, staleness, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
calls = []
def reward(prompts, completions, **kw):
    calls.append(1)
    if mode == "kill" and len(calls) == 3:  # kill -9 while step 2 is made, generations in flight
        def parent(p):
            try:
                return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]
            except OSError:
                return None
        kids = [p for p in os.listdir("/proc") if p.isdigit() and parent(p) == str(os.getpid())]
        open(os.path.join(out, "children"), "w").write(" ".join(kids))
        os.kill(os.getpid(), signal.SIGKILL)
    return digit_sum(prompts, completions)
args = args_of(out, rollout_engine=engine, max_staleness=staleness, max_completion_length=3, save_strategy="steps",
               save_steps=1)
result = train(lm(), args, DATA, reward, codec=CODEC, resume_from_checkpoint=mode == "resume")
torch.save(dict(result.state.params), os.path.join(out, "final.pt"))
"""


def _script(out, engine: str, staleness: int, mode: str) -> tuple[int, str]:
    """Run ``_SCRIPT`` in a fresh process; its output goes to a file (a server it leaves holds no pipe of ours)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, "-c", _SCRIPT, str(out), engine, str(staleness), mode]
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    log = pathlib.Path(out) / f"{mode}.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300).returncode
    return code, log.read_text()[-2000:]


def _reap(pids: list[int], wait_s: float) -> list[int]:
    """Wait up to ``wait_s`` for ``pids`` (the killed trainer's children) to exit; kill and return those alive."""
    import os
    import time

    deadline = time.monotonic() + wait_s
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
    for p in alive:  # the test's own grandchildren: never leave them behind
        os.kill(p, 9)
    return alive


# reduced (CI): the local engine; the process engine's resume in a fresh engine is the SIGTERM and stop-and-resume
# tests' (TRAINFOLD_SLOW=full kills both)
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["local", "process"] if os.environ.get("TRAINFOLD_SLOW") == "full" else ["local"])
def test_kill_9_with_generations_in_flight_resumes_bitwise_in_a_fresh_process(tmp_path, engine):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the script's processes (OMP_NUM_THREADS=1): the run that never stopped, here
    try:
        args = args_of(tmp_path / "a", rollout_engine=engine, max_staleness=1, max_completion_length=3,
                       save_strategy="steps", save_steps=1)  # fmt: skip
        straight = train(lm(), args, DATA, digit_sum, codec=CODEC)
    finally:
        torch.set_num_threads(threads)
    code, log = _script(tmp_path / "b", engine, 1, "kill")
    assert code == -9, log
    _reap([int(p) for p in (tmp_path / "b" / "children").read_text().split()], wait_s=5)
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    code, log = _script(tmp_path / "b", engine, 1, "resume")
    assert code == 0, log
    want, got = dict(straight.state.params), torch.load(tmp_path / "b" / "final.pt")
    assert not torch.equal(want["tok.weight"], lm().tok.weight)
    for k in want:
        assert torch.equal(want[k], got[k]), k


_ORPHAN = """
import os, signal, sys, torch
sys.path.insert(0, "tests")
from test_grpo_async import lm
from trainfold.rollout import ProcessEngine
engine = ProcessEngine(lm())
engine.publish(0, lm().state_dict())
open(sys.argv[1], "w").write(str(engine.process.pid))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_generation_server_exits_when_its_trainer_is_killed_9(tmp_path):
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src")}
    pid_file = tmp_path / "server.pid"
    with open(tmp_path / "log", "w") as f:
        code = subprocess.run(
            [sys.executable, "-c", _ORPHAN, str(pid_file)], cwd=root, env=env, stdout=f, stderr=f, timeout=120
        ).returncode
    assert code == -9
    assert _reap([int(pid_file.read_text())], wait_s=10) == [], "the server outlived its killed trainer"


def test_settings_the_run_cannot_honour_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"rollout_engine='vllm' needs a served model: pass engine=.*VLLMEngine"):
        grpo_stream(lm(), args_of(tmp_path, rollout_engine="vllm"), DATA, digit_sum, codec=CODEC)
    with pytest.raises(ValueError, match=r"loss_type='vespo' with the importance-sampling correction"):
        args_of(tmp_path, loss_type="vespo", max_staleness=1)
    assert args_of(tmp_path, loss_type="vespo", max_staleness=1, vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match=r"_cap=2.0 .* and vllm_importance_sampling_clip_max=4.0 disagree"):
        args_of(tmp_path, vllm_importance_sampling_cap=2.0, vllm_importance_sampling_clip_max=4.0)
    with pytest.raises(ValueError, match=r"max_staleness must be >= 0, got -1"):
        args_of(tmp_path, max_staleness=-1)
