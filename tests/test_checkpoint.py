"""Checkpoints: round trip, atomic writes, errors naming the path, bitwise resume in a fresh process, policy."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.ckpt import (
    INCOMPLETE_MARKER,
    MODEL_FILE,
    SIDECAR_FILE,
    STATE_FILE,
    checkpoint_path,
    faults,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load,
    load_weights,
    model_weights,
    read_metadata,
    resume_checkpoint,
    save,
    warm_start,
)
from trainfold.ckpt.best import best_metric, greater_is_better_for, update_best
from trainfold.ckpt.policy import best_checkpoint, check_compatible, rotate, should_save
from trainfold.core.fold import trajectory
from trainfold.core.state import Cursor, TrainState, init_state, scalar
from trainfold.core.tree import flatten
from trainfold.optim import adamw, sgd

# The run the resume tests share: resume_fixture.fold_run, here and in the subprocesses.
SETUP = textwrap.dedent(
    f"""
    import sys
    import torch
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    from resume_fixture import fold_run

    N_STEPS = 10

    def make_run():
        return fold_run(N_STEPS)
    """
)


@contextlib.contextmanager
def one_thread():
    """Run with one intra-op thread, as the subprocesses do, so float reductions match bitwise."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def run_setup() -> dict:
    ns: dict = {}
    exec(SETUP, ns)
    return ns


def python(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, **kw)


def small_state(seed: int = 0, d: int = 3) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    return init_state(model, adamw(1e-3), seed=seed)


def at_step(step: int, seed: int = 0) -> TrainState:
    """A small state at ``step``: a checkpoint-{step} directory must hold that step."""
    return attrs.evolve(small_state(seed), step=scalar(step))


def assert_states_equal(a: TrainState, b: TrainState) -> None:
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]), k


# -- concrete examples ------------------------------------------------------------------------------


def test_save_writes_the_layout_and_load_restores_every_tensor(tmp_path):
    state = small_state()
    state = attrs.evolve(state, step=scalar(12), cursor=Cursor(scalar(1), scalar(3)))
    path = save(state, checkpoint_path(tmp_path, 12), metadata={"best_metric": 0.5}, settings={"seed": 0})
    assert path == tmp_path / "checkpoint-12"
    assert sorted(p.name for p in path.iterdir()) == sorted([MODEL_FILE, STATE_FILE, SIDECAR_FILE])
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-12"]  # no temporary left behind
    meta = read_metadata(path)
    assert (meta["step"], meta["epoch"], meta["cursor"]) == (12, 1, {"epoch": 1, "position": 3})
    assert meta["metadata"] == {"best_metric": 0.5} and meta["settings"] == {"seed": 0}
    assert meta["jit"] is False and meta["save_only_model"] is False
    assert_states_equal(load(path, like=small_state(seed=1)), state)


def test_load_takes_metrics_as_saved_and_devices_from_the_template(tmp_path):
    state = small_state()
    state = attrs.evolve(state, metrics={**state.metrics, "rewards/margins": torch.tensor(1.5)})
    loaded = load(save(state, tmp_path / "c"), like=small_state())
    assert loaded.metrics.keys() == state.metrics.keys()
    assert loaded.metrics["rewards/margins"].item() == 1.5


def test_save_does_not_mutate_and_handles_shared_and_strided_tensors(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    params = {"w": base, "wt": base.T, "row": base[1]}  # one storage, a transposed view, a slice
    state = TrainState(params=params, buffers={}, opt_state=())
    versions = {k: v._version for k, v in params.items()}
    loaded = load(save(state, tmp_path / "c"), like=state)
    for k in params:
        assert torch.equal(loaded.params[k], params[k]) and params[k]._version == versions[k]


def test_save_replaces_an_existing_checkpoint(tmp_path):
    save(small_state(seed=0), tmp_path / "c")
    save(small_state(seed=1), tmp_path / "c", jit=True)
    assert read_metadata(tmp_path / "c")["jit"] is True
    assert_states_equal(load(tmp_path / "c", like=small_state()), small_state(seed=1))
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_config_json_from_a_dict_or_the_models_config(tmp_path):
    from trainfold.core.models import TinyLM, TinyLMConfig

    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    state = init_state(model, sgd(0.1))
    save(state, tmp_path / "a", model=model)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["d_model"] == 8
    save(state, tmp_path / "b", config={"hidden": 3})
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == {"hidden": 3}
    with pytest.raises(TypeError, match="config of type int"):
        save(state, tmp_path / "c", config=3)


def test_model_weights_use_state_dict_names_with_ties_once():
    from trainfold.core.models import TinyLM, TinyLMConfig

    model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    state = init_state(model, sgd(0.1))
    weights = model_weights(state, model)
    assert "scratch" not in weights
    assert sorted(weights) == sorted(state.params)


# -- properties ---------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


names = st.text("abcxyz_", min_size=1, max_size=4)
trees = st.dictionaries(names, tensors(), max_size=4)


@settings(max_examples=15, deadline=None)
@given(
    params=st.dictionaries(names, tensors(), min_size=1, max_size=4),
    buffers=trees,
    opt=st.tuples(trees, trees),
    metrics=trees,
    step=st.integers(0, 10**6),
)
def test_round_trip_property(tmp_path_factory, params, buffers, opt, metrics, step):
    state = TrainState(
        params=params,
        buffers=buffers,
        opt_state=opt,
        step=scalar(step),
        metrics=metrics,
        extras={"best": best_metric(greater_is_better=True)},
    )
    path = save(state, tmp_path_factory.mktemp("rt") / "c")
    assert_states_equal(load(path, like=state), state)


# -- errors name the path ------------------------------------------------------------------------------


def test_missing_files_name_the_path(tmp_path):
    path = save(small_state(), tmp_path / "c")
    (path / STATE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{path / STATE_FILE}.*is missing"):
        load(path, like=small_state())
    (path / SIDECAR_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"{path / SIDECAR_FILE}.*is missing"):
        load(path, like=small_state())


def test_truncated_and_corrupted_files_name_the_path(tmp_path):
    path = save(small_state(), tmp_path / "c")
    data = (path / STATE_FILE).read_bytes()
    (path / STATE_FILE).write_bytes(data[:-7])
    with pytest.raises(ValueError, match=f"{path / STATE_FILE} is truncated"):
        load(path, like=small_state())
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    (path / STATE_FILE).write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=f"{path / STATE_FILE} is corrupted"):
        load(path, like=small_state())
    (path / SIDECAR_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{path / SIDECAR_FILE} is corrupted"):
        load(path, like=small_state())


def test_a_newer_format_or_a_foreign_sidecar_is_refused(tmp_path):
    path = save(small_state(), tmp_path / "c")
    meta = json.loads((path / SIDECAR_FILE).read_text())
    (path / SIDECAR_FILE).write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match=f"{path / SIDECAR_FILE} has checkpoint format 99.*upgrade trainfold"):
        read_metadata(path)
    (path / SIDECAR_FILE).write_text(json.dumps({"global_step": 3}))
    with pytest.raises(ValueError, match="is not a trainfold checkpoint sidecar"):
        load(path, like=small_state())


def test_a_tensor_file_the_sidecar_does_not_vouch_for_is_refused(tmp_path):
    path = save(small_state(), tmp_path / "c")
    meta = json.loads((path / SIDECAR_FILE).read_text())
    del meta["files"][STATE_FILE]
    (path / SIDECAR_FILE).write_text(json.dumps(meta))
    (path / STATE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match=f"{path / SIDECAR_FILE}: field 'files.state.safetensors' is missing"):
        load(path, like=small_state())


def test_a_different_model_names_the_path_and_the_keys(tmp_path):
    path = save(small_state(), tmp_path / "c")
    other = init_state(torch.nn.Linear(3, 2), adamw(1e-3))
    with pytest.raises(KeyError, match=r"state.safetensors does not fit.*different model.*missing \[.*unexpected \["):
        load(path, like=other)
    with pytest.raises(ValueError, match=r"(?s)state.safetensors does not fit.*params.0.weight: loaded \(4, 3\)"):
        load(path, like=small_state(d=5))
    with pytest.raises(KeyError, match=r"model.safetensors does not fit.*missing"):
        load_weights(path, like=other)


def test_weights_only_checkpoint_refuses_resume_and_warm_starts_with_a_warning(tmp_path):
    trained = attrs.evolve(small_state(seed=1), step=scalar(9))
    path = save(trained, tmp_path / "c", save_only_model=True)
    assert not (path / STATE_FILE).exists()
    with pytest.raises(ValueError, match=f"{path / STATE_FILE} does not exist.*save_only_model.*warm_start"):
        load(path, like=small_state())
    fresh = small_state(seed=0)
    with pytest.warns(UserWarning, match="warm start.*restart from step 0"):
        warm = warm_start(path, like=fresh)
    assert warm.step.item() == 0 and warm.opt_state is fresh.opt_state
    for k in trained.params:
        assert torch.equal(warm.params[k], trained.params[k])
    assert torch.equal(warm.buffers["1.running_mean"], trained.buffers["1.running_mean"])


def test_metadata_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="save metadata must be JSON-serialisable"):
        save(small_state(), tmp_path / "c", metadata={"t": torch.zeros(1)})
    assert not tmp_path.joinpath("c").exists()


# -- atomicity -----------------------------------------------------------------------------------------

CRASH = textwrap.dedent(
    """
    import sys, time, attrs, torch
    from trainfold.ckpt import save, checkpoint_path, faults
    from trainfold.optim import adamw
    from trainfold.core.state import init_state, scalar
    out = sys.argv[1]
    state = init_state(torch.nn.Linear(64, 64), adamw(1e-3))
    save(attrs.evolve(state, step=scalar(1)), checkpoint_path(out, 1))
    def pause(label):
        if label.startswith("save:wrote:"):
            print("wrote", label.removeprefix("save:wrote:"), flush=True)
            time.sleep(60)
    faults.fault_hook = pause
    save(attrs.evolve(state, step=scalar(int(sys.argv[2]))), checkpoint_path(out, int(sys.argv[2])))
    """
)


@pytest.mark.parametrize("second", [2, 1])  # a new step, and a rewrite of the step already there
def test_kill_9_during_save_leaves_the_previous_complete_checkpoint(tmp_path, second):
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH, str(tmp_path), str(second)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == f"wrote {STATE_FILE}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(hidden) == 1 and (hidden[0] / INCOMPLETE_MARKER).exists()  # it died mid-write
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint-1"]
    assert read_metadata(tmp_path / "checkpoint-1")["step"] == 1


def test_an_error_during_save_removes_the_temporary_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    save(small_state(seed=0), tmp_path / "c")

    def fail(label):
        if label.startswith("save:wrote:"):
            raise OSError(f"disk full while writing {label}")

    monkeypatch.setattr(faults, "fault_hook", fail)
    with pytest.raises(OSError, match="disk full"):
        save(small_state(seed=1), tmp_path / "c")
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert_states_equal(load(tmp_path / "c", like=small_state()), small_state(seed=0))


def test_latest_checkpoint_skips_incomplete_directories(tmp_path):
    for step in (1, 3, 5, 7, 9):
        save(at_step(step), checkpoint_path(tmp_path, step))
    (tmp_path / "checkpoint-9" / INCOMPLETE_MARKER).write_text("")  # a foreign, non-atomic writer
    (tmp_path / "checkpoint-7" / MODEL_FILE).unlink()
    with open(tmp_path / "checkpoint-5" / STATE_FILE, "r+b") as f:
        f.truncate(10)
    (tmp_path / "checkpoint-11").mkdir()
    (tmp_path / "checkpoint-final").mkdir()
    save(at_step(20), tmp_path / ".checkpoint-20.tmp-1-ab")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-3"]
    assert not is_complete(tmp_path / "checkpoint-9")
    with pytest.raises(ValueError, match="checkpoint-9 is an incomplete checkpoint"):
        load(tmp_path / "checkpoint-9", like=small_state())


def test_resume_checkpoint_follows_resume_from_checkpoint(tmp_path):
    assert resume_checkpoint(None, tmp_path) is None and resume_checkpoint(False, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint=True but .* holds no complete"):
        resume_checkpoint(True, tmp_path)
    for step in (2, 4):
        save(at_step(step), checkpoint_path(tmp_path, step))
    (tmp_path / "checkpoint-4" / MODEL_FILE).write_bytes(b"")
    assert resume_checkpoint(True, tmp_path) == tmp_path / "checkpoint-2"
    assert resume_checkpoint(tmp_path / "checkpoint-2", tmp_path) == tmp_path / "checkpoint-2"
    with pytest.raises(ValueError, match="checkpoint-4 is incomplete"):
        resume_checkpoint(str(tmp_path / "checkpoint-4"), tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint-9/trainfold.json is missing"):
        resume_checkpoint(tmp_path / "checkpoint-9", tmp_path)


# -- bitwise resume in a fresh process --------------------------------------------------------------------

RESUME = SETUP + textwrap.dedent(
    """
    import sys
    from trainfold.ckpt import load, save
    from trainfold.core.fold import trajectory
    torch.set_num_threads(1)
    model, step, fresh, batches = make_run()
    for path in sys.argv[1:]:
        state = load(path, like=fresh)
        losses = []
        for state in trajectory(step, state, batches[int(state.step):]):
            losses.append(state.metrics["loss"].item())
        save(state, path + "-resumed", metadata={"losses": losses})
    """
)


def test_resume_in_a_fresh_process_is_bitwise_equal_to_not_stopping(tmp_path):
    ns = run_setup()
    with one_thread():
        model, step, state, batches = ns["make_run"]()
        states = list(trajectory(step, state, batches))
    n = ns["N_STEPS"]
    paths = [str(save(states[k - 1], checkpoint_path(tmp_path, k), model=model)) for k in (1, 4, n - 1)]
    done = python(RESUME, *paths)
    assert done.returncode == 0, done.stderr
    for k, p in zip((1, 4, n - 1), paths):
        assert_states_equal(load(p + "-resumed", like=state), states[-1])
        losses = read_metadata(p + "-resumed")["metadata"]["losses"]
        assert losses == [s.metrics["loss"].item() for s in states[k:]]  # every later step's loss, exactly


# -- policy --------------------------------------------------------------------------------------------


def test_should_save_follows_the_strategy():
    assert [s for s in range(1, 11) if should_save(s, save_strategy="steps", save_steps=4)] == [4, 8]
    assert [s for s in range(1, 11) if should_save(s, save_strategy="steps", save_steps=0.25, max_steps=10)] == [
        3,
        6,
        9,
        10,
    ]
    assert should_save(5, save_strategy="epoch", epoch_end=True) and not should_save(5, save_strategy="epoch")
    assert should_save(5, save_strategy="best", new_best=True) and not should_save(5, save_strategy="best")
    with pytest.raises(ValueError, match="save_strategy 'sometimes' is not one of"):
        should_save(1, save_strategy="sometimes")
    with pytest.raises(ValueError, match="pass max_steps"):
        should_save(1, save_strategy="steps", save_steps=0.5)


def make_checkpoints(root: Path, steps, jit=()):
    for s in steps:
        save(at_step(s), checkpoint_path(root, s), jit=s in jit)


def names(root: Path) -> list[str]:
    return [p.name for p in list_checkpoints(root)]


def test_rotate_deletes_the_oldest_by_step(tmp_path):
    make_checkpoints(tmp_path, [10, 2, 30, 4])
    deleted = rotate(tmp_path, 2)
    assert [p.name for p in deleted] == ["checkpoint-2", "checkpoint-4"]
    assert names(tmp_path) == ["checkpoint-10", "checkpoint-30"]
    assert rotate(tmp_path, None) == [] and rotate(tmp_path, 2) == []


def test_rotate_keeps_the_best_and_the_latest_with_limit_1(tmp_path):
    make_checkpoints(tmp_path, [1, 2, 3])
    best = best_metric(greater_is_better=False)
    best, _ = update_best(best, 0.1, 2)
    rotate(tmp_path, 1, keep=[best_checkpoint(tmp_path, best)])
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-3"]


def test_rotate_deletes_an_older_jit_checkpoint_but_never_the_newest_or_an_incomplete_one(tmp_path):
    make_checkpoints(tmp_path, [1, 2, 3, 4, 5], jit=[1, 5])
    (tmp_path / "checkpoint-0").mkdir()
    rotate(tmp_path, 1)
    assert names(tmp_path) == ["checkpoint-5"]
    assert (tmp_path / "checkpoint-0").is_dir()
    with pytest.raises(ValueError, match="save_total_limit must be a positive int"):
        rotate(tmp_path, 0)


@settings(max_examples=20, deadline=None)
@given(steps=st.sets(st.integers(0, 50), min_size=1, max_size=6), limit=st.integers(1, 4), data=st.data())
def test_rotation_property(tmp_path_factory, steps, limit, data):
    root = tmp_path_factory.mktemp("rot")
    best = data.draw(st.sampled_from(sorted(steps)))
    make_checkpoints(root, steps)
    rotate(root, limit, keep=[checkpoint_path(root, best)])
    kept = [int(n.split("-")[1]) for n in names(root)]
    protected = {max(steps), best}
    assert protected <= set(kept)
    assert len(kept) == min(len(steps), max(limit, len(protected)))
    deleted = set(steps) - set(kept)
    assert all(d < k for d in deleted for k in set(kept) - protected)  # the oldest went first


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("eval_loss", False),
        ("loss", False),
        ("eval_nll_loss_avg", False),
        ("eval_perplexity", False),
        ("wer", False),
        ("eval_mean_squared_error", False),
        ("eval_accuracy", True),
        ("f1", True),
        ("eval_rougeL", True),
        ("bleu", True),
        ("eval_exact_match", True),
        ("eval_answer_accuracy", True),
    ],
)
def test_greater_is_better_defaults_where_certain(name, expected):
    assert greater_is_better_for(name) is expected


@pytest.mark.parametrize("name", ["eval_score", "eval_reward", "eval_accuracy_loss", "runtime"])
def test_greater_is_better_is_required_otherwise(name):
    with pytest.raises(ValueError, match=f"{name}.*pass greater_is_better=True or False"):
        greater_is_better_for(name)
    assert greater_is_better_for(name, greater_is_better=True) is True


def test_best_metric_tracker_survives_a_save_and_load(tmp_path):
    best = best_metric(greater_is_better=True)
    for step, value in [(1, 0.5), (2, 0.7), (3, float("nan")), (4, 0.7), (5, 0.6)]:
        best, _ = update_best(best, value, step)
    assert (best.value.item(), best.step.item()) == (0.7, 2)
    state = attrs.evolve(small_state(), extras={"best": best})
    template = attrs.evolve(small_state(), extras={"best": best_metric(greater_is_better=True)})
    loaded = load(save(state, tmp_path / "c"), like=template).extras["best"]
    assert (loaded.value.item(), loaded.step.item(), bool(loaded.greater_is_better)) == (0.7, 2, True)


def test_check_compatible_lists_every_sample_order_difference():
    from trainfold import TrainingArguments
    from trainfold.ckpt.run_identity import RunSettings

    def settings(**over):
        base = dict(gradient_accumulation_steps=2, per_device_train_batch_size=8, seed=0, learning_rate=1e-3)
        return RunSettings.of(TrainingArguments(**{**base, **over}), world_size=1)

    saved = settings().values
    check_compatible(saved, settings(learning_rate=5e-4, warmup_steps=10))  # the schedule may change
    with pytest.raises(
        ValueError,
        match=r"from out/checkpoint-3 with different settings: gradient_accumulation_steps: saved 2, now 4; "
        r"seed: saved 0, now 3; resume",
    ):
        check_compatible(saved, settings(gradient_accumulation_steps=4, seed=3), source="out/checkpoint-3")


# -- transformers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_model_safetensors_loads_with_from_pretrained(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    state = init_state(model, adamw(1e-3))
    g = torch.Generator().manual_seed(1)
    state = attrs.evolve(
        state, params={k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.params.items()}
    )
    path = save(state, tmp_path / "c", model=model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state.params[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.LlamaForCausalLM.from_pretrained(path)
    ids = torch.randint(0, 64, (2, 10), generator=g)
    model.eval()
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    import safetensors.torch

    saved = safetensors.torch.load_file(path / MODEL_FILE)
    assert ("lm_head.weight" in saved) is (not tie)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is tie
