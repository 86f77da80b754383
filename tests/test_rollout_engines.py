"""One conformance suite over every rollout engine (trainfold.rollout): local, process and vLLM.

Each backend must: give the same completion for the same (weights version, prompt, spec, seed); record the
version of every token span, in the order publishes and submits were made; keep its old version when a
publish fails midway; round-trip its open requests through ``state_dict``. On CPU the process engine's
completions are bitwise the local engine's, and the local engine's are ``core.generate``'s with the
request's seed, with the log-probs the trainer recomputes. The vLLM backend's tests need vLLM and a GPU and
are skipped, by name, elsewhere.
"""

import importlib.util
import json
import os
import signal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainfold.core.generate import filter_logits, functional_forward, generate
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.grpo.objective import next_token_logps
from trainfold.rollout import Completion, EngineDied, LocalEngine, RolloutEngine, RolloutRequest, SamplingSpec
from trainfold.rollout.process import ProcessEngine
from trainfold.rollout.transport import plan_buckets

EOS = 3
HAS_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.device_count() >= 2
NO_VLLM = pytest.mark.skipif(not HAS_VLLM, reason="vllm backend: needs vllm and 2 CUDA GPUs (server, trainer)")
BACKENDS = ["local", "process"]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return TinyLM(TinyLMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_len=48))


def shifted(model, by):
    """Other weights of the same model (a later version)."""
    g = torch.Generator().manual_seed(by)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def make_engine(backend, model):
    if backend == "local":
        return LocalEngine(model, eos_token_id=EOS)
    return ProcessEngine(model, eos_token_id=EOS, bucket_mb=0.001)  # tiny buckets: many of them


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, model):
    e = make_engine(request.param, model)
    yield e
    e.close()


def requests(tag, n=4, **spec):
    return [
        RolloutRequest(f"{tag}{i}", [1 + i, 5, 7][: 1 + i % 3], SamplingSpec(max_new_tokens=6, seed=100 + i, **spec))
        for i in range(n)
    ]


def poll_all(engine, n):
    out = engine.poll(min_items=n)
    assert len(out) == n
    return out


def reference(model, weights, reqs, version):
    """The local engine's completions for ``reqs`` under ``weights``: the suite's oracle."""
    e = LocalEngine(model, eos_token_id=EOS)
    e.publish(version, weights)
    e.submit(reqs)
    return e.poll()


def assert_same(got, want):
    assert [c.request_id for c in got] == [c.request_id for c in want]
    for a, b in zip(got, want):
        assert a.same_as(b), (a.request_id, a.completion_ids, b.completion_ids)


def test_every_backend_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


def test_the_same_request_gives_the_same_completion(engine, model):
    engine.publish(0, model.state_dict())
    assert engine.poll() == []
    engine.submit(requests("det-a", top_k=4))
    a = poll_all(engine, 4)
    engine.submit(requests("det-b", top_k=4))
    b = poll_all(engine, 4)
    for x, y in zip(a, b):
        assert x.completion_ids == y.completion_ids and torch.equal(x.logps, y.logps)
        assert x.logps.dtype == torch.float32 and len(x.logps) == len(x.completion_ids)
    seeds = [c.completion_ids for c in a]
    assert len(set(seeds)) > 1  # the seeds differ, so do the samples


def test_each_completion_records_the_version_published_before_its_submit(engine, model):
    v0, v1, v2 = model.state_dict(), shifted(model, 1), shifted(model, 2)
    before = {k: v.clone() for k, v in v0.items()}
    engine.publish(10, v0)
    engine.submit(requests("ver-a"))
    engine.publish(11, v1)  # a publish while requests may still be generating
    engine.submit(requests("ver-b"))
    engine.publish(12, v2)  # the process engine receives these into the buffers version 10 used
    engine.publish(13, v0)
    engine.submit(requests("ver-c"))
    got = poll_all(engine, 12)
    assert [c.version_spans for c in got] == [((10, 0),)] * 4 + [((11, 0),)] * 4 + [((13, 0),)] * 4
    assert_same(got[:4], reference(model, v0, requests("ver-a"), 10))
    assert_same(got[4:8], reference(model, v1, requests("ver-b"), 11))
    assert_same(got[8:], reference(model, v0, requests("ver-c"), 13))
    assert all(c.token_versions().tolist() == [11] * len(c.completion_ids) for c in got[4:8])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the trainer's model untouched


def test_a_publish_that_fails_midway_leaves_the_old_version(engine, model):
    engine.publish(20, model.state_dict())

    def breaks_midway():
        for i, (k, v) in enumerate(model.state_dict().items()):
            if i == 3:
                raise OSError("lost the shard")
            yield k, v + 1.0

    with pytest.raises(OSError, match="lost the shard"):
        engine.publish(21, breaks_midway())
    bad = {**shifted(model, 2), "not.a.weight": torch.zeros(2)}
    bad["tok.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"keeps its version: 'tok.weight' is \(3, 3\) .*; unknown weight 'not\.a"):
        engine.publish(22, bad)
    assert engine.version == 20
    engine.submit(requests("atomic"))
    assert_same(poll_all(engine, 4), reference(model, model.state_dict(), requests("atomic"), 20))


def test_open_requests_round_trip_through_state_dict(request, engine, model):
    backend = request.node.callspec.params["engine"]
    weights = shifted(model, 3)
    engine.publish(30, weights)
    engine.submit(requests("sd"))
    state = engine.state_dict()
    json.dumps({**state, "completions": [{**c, "logps": c["logps"].tolist()} for c in state["completions"]]})
    uninterrupted = poll_all(engine, 4)
    fresh = make_engine(backend, model)
    try:
        fresh.publish(30, weights)
        fresh.load_state_dict(state)
        assert_same(fresh.poll(min_items=4), uninterrupted)
        # a checkpoint that holds requests not yet generated: regenerated with the same version
        pending = {"completions": [], "pending": [{"request": r.to_dict(), "version": 30} for r in requests("sd")]}
        fresh.load_state_dict(pending)
        assert_same(fresh.poll(min_items=4), uninterrupted)
        with pytest.raises(ValueError, match=r"need weight versions \[29\]; this engine is on 30"):
            fresh.load_state_dict({"completions": [], "pending": [{**pending["pending"][0], "version": 29}]})
    finally:
        fresh.close()


def test_errors_name_the_request_and_the_fix(engine, model):
    e = make_engine("local", model)
    with pytest.raises(RuntimeError, match=r"submit before any publish: call engine.publish"):
        e.submit(requests("early"))
    engine.publish(40, model.state_dict())
    engine.submit(requests("dup", n=1))
    with pytest.raises(ValueError, match="request id 'dup0' is already open"):
        engine.submit(requests("dup", n=1))
    poll_all(engine, 1)


# -- the local engine against today's generation, the process engine against the local one --------------


def test_local_tokens_are_core_generate_and_log_probs_the_trainers(model):
    reqs = requests("core", n=3)
    got = reference(model, model.state_dict(), reqs, 0)
    params = dict(model.named_parameters())
    for r, c in zip(reqs, got):
        (ids,) = generate(
            model, params, [list(r.prompt_ids)], max_new_tokens=6, eos_token_id=EOS,
            generator=torch.Generator().manual_seed(r.spec.seed),
        )  # fmt: skip
        assert list(c.completion_ids) == ids
        full = torch.tensor([list(r.prompt_ids) + ids])
        inputs = {"input_ids": full, "attention_mask": torch.ones_like(full)}
        trainer = next_token_logps(functional_forward(model), params, inputs, None, 0, 1.0)[0, len(r.prompt_ids) - 1 :]
        assert torch.equal(c.logps, trainer)


def test_process_completions_are_the_local_ones_bitwise_on_a_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    reqs = requests("llama", n=8, top_p=0.9, temperature=0.8)  # prompts of 3 lengths: 3 batches
    local, remote = LocalEngine(llama, eos_token_id=EOS), ProcessEngine(llama, eos_token_id=EOS)
    try:
        for e in (local, remote):
            e.publish(1, shifted(llama, 5))
            e.submit(reqs)
        assert_same(remote.poll(min_items=8), local.poll())
    finally:
        remote.close()


def test_a_dead_server_is_named_by_poll_submit_and_publish(model):
    e = ProcessEngine(model, eos_token_id=EOS)
    try:
        e.publish(7, model.state_dict())
        os.kill(e.process.pid, signal.SIGSTOP)  # nothing finishes before the kill
        e.submit(requests("dead", n=2))
        os.kill(e.process.pid, signal.SIGKILL)
        e.process.join(timeout=30)
        for call in (lambda: e.poll(min_items=2), lambda: e.submit(requests("more")), lambda: e.publish(8, {})):
            with pytest.raises(EngineDied, match=rf"pid {e.process.pid}\) died with exit code -9 .*start a new"):
                call()
        with pytest.raises(EngineDied) as died:
            e.poll()
    finally:
        e.close()
    lost = died.value.lost
    assert [(r.request_id, v) for r, v in lost] == [("dead0", 7), ("dead1", 7)]
    again = make_engine("local", model)  # a new engine of that version regenerates them exactly
    again.publish(7, model.state_dict())
    again.submit([r for r, _ in lost])
    assert_same(again.poll(), reference(model, model.state_dict(), requests("dead", n=2), 7))


def test_completion_round_trips_its_dict(model):
    (c,) = reference(model, model.state_dict(), requests("dict", n=1), 7)
    assert Completion.from_dict(c.to_dict()).same_as(c)


# -- the vLLM engine: the same contract, against itself (its kernels are not the local engine's) -------------


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    import subprocess
    import time

    import requests
    import transformers

    from trainfold.rollout.vllm import VLLMEngine

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("llama")
    llama.save_pretrained(path)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_BATCH_INVARIANT": "1", "CUDA_VISIBLE_DEVICES": "0"}
    server = subprocess.Popen(
        ["vllm", "serve", str(path), "--port", "8765", "--load-format", "dummy", "--enforce-eager",
         "--skip-tokenizer-init", "--max-model-len", "128", "--gpu-memory-utilization", "0.3",
         "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs"],
        env=env,
    )  # fmt: skip
    for _ in range(300):
        try:
            if requests.get("http://127.0.0.1:8765/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            time.sleep(1)
    torch.cuda.set_device(1)
    engine = VLLMEngine("http://127.0.0.1:8765", str(path), eos_token_id=EOS, pause_mode="wait")
    yield engine, llama
    engine.close()
    server.terminate()
    server.wait(timeout=60)


@NO_VLLM
def test_vllm_engine_is_deterministic_and_versions_its_completions(vllm_engine):
    engine, llama = vllm_engine
    engine.publish(0, llama.state_dict())
    engine.submit(requests("vllm-a", top_k=4))
    engine.publish(1, shifted(llama, 1))
    engine.submit(requests("vllm-b", top_k=4) + requests("vllm-c", top_k=4))
    got = poll_all(engine, 12)
    assert [c.version_spans for c in got] == [((0, 0),)] * 4 + [((1, 0),)] * 8
    for b, c in zip(got[4:8], got[8:]):
        assert b.completion_ids == c.completion_ids and torch.equal(b.logps, c.logps)


@NO_VLLM
def test_vllm_engine_keeps_its_version_when_a_publish_fails_and_round_trips_state(vllm_engine):
    engine, llama = vllm_engine
    engine.publish(5, llama.state_dict())

    def breaks_midway():
        yield from list(llama.state_dict().items())[:2]
        raise OSError("lost the shard")

    with pytest.raises(OSError, match="lost the shard"):
        engine.publish(6, breaks_midway())
    assert engine.version == 5
    engine.submit(requests("vllm-sd"))
    state = engine.state_dict()
    got = engine.poll()
    engine.load_state_dict(state)
    assert_same(engine.poll(), got)


class Sharded:
    """A stand-in for an FSDP2 DTensor: ``full_tensor()`` is its collective (counted)."""

    calls: list[str] = []

    def __init__(self, name, full):
        self.name, self.full = name, full

    def full_tensor(self):
        Sharded.calls.append(self.name)
        return self.full


def test_sharded_weights_are_gathered_in_one_pass_before_any_byte_moves(model):
    engine = ProcessEngine(model, eos_token_id=EOS, bucket_mb=0.001)
    sends = []
    real_send = engine._channel.send
    engine._channel.send = lambda tensors, buckets: (sends.append(len(Sharded.calls)), real_send(tensors, buckets))
    try:
        Sharded.calls = []
        weights = shifted(model, 4)
        engine.publish(1, ((k, Sharded(k, v)) for k, v in weights.items()))
        assert Sharded.calls == list(weights) and sends == [len(weights)]  # every gather first, in order
        engine.submit(requests("sharded"))
        assert_same(engine.poll(min_items=4), reference(model, weights, requests("sharded"), 1))
    finally:
        engine.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_the_model_cannot_serve_is_named(backend, model):
    engine = make_engine(backend, model)
    try:
        engine.publish(0, model.state_dict())
        too_long = RolloutRequest("too-long", list(range(1, 46)), SamplingSpec(max_new_tokens=8, seed=0))
        with pytest.raises(RuntimeError, match=r"failed on request 'too-long': \w+Error"):
            engine.submit([too_long, *requests("fine", n=2)])
            engine.poll(min_items=3)
        assert engine.poll() == [] and engine.state_dict()["completions"] == []  # nothing of that submit waits
        engine.submit(requests("after", n=2))
        assert [c.request_id for c in engine.poll(min_items=2)] == ["after0", "after1"]
    finally:
        engine.close()


@settings(max_examples=15, deadline=None)
@given(
    prompt=st.lists(st.integers(1, 31), min_size=1, max_size=6),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, 1, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    seed=st.integers(0, 2**31),
)
def test_local_completions_are_core_generate_for_any_spec(model, prompt, temperature, top_k, top_p, seed):
    spec = SamplingSpec(max_new_tokens=5, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    (c,) = reference(model, model.state_dict(), [RolloutRequest("h", prompt, spec)], 0)
    (ids,) = generate(
        model, dict(model.named_parameters()), [prompt], max_new_tokens=5, temperature=temperature, eos_token_id=EOS,
        generator=torch.Generator().manual_seed(seed), top_k=top_k, top_p=top_p,
    )  # fmt: skip
    assert list(c.completion_ids) == ids and len(c.logps) == len(ids) and bool(c.logps.isfinite().all())
    assert c.finish_reason == ("stop" if ids and ids[-1] == EOS else "length")


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    bucket=st.integers(4, 64),
    direct=st.integers(8, 100),
)
def test_buckets_hold_every_tensor_once_in_order_within_their_size(sizes, bucket, direct):
    metas = [(f"t{i}", (n,), "uint8") for i, n in enumerate(sizes)]
    buckets = plan_buckets(metas, bucket, direct)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for b in buckets:
        assert len(b) == 1 or (sum(sizes[i] for i in b) <= bucket and all(sizes[i] < direct for i in b))


def test_poll_waits_at_most_its_timeout(model):
    engine = ProcessEngine(model, eos_token_id=EOS)
    try:
        engine.publish(0, model.state_dict())
        os.kill(engine.process.pid, signal.SIGSTOP)  # a server that gives nothing, for as long as we like
        try:
            engine.submit([RolloutRequest("slow", [1], SamplingSpec(max_new_tokens=4, seed=0))])
            with pytest.raises(TimeoutError, match=r"gave nothing for 0.2s during poll"):
                engine.poll(min_items=1, timeout_s=0.2)
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)
        assert [c.request_id for c in engine.poll(min_items=1)] == ["slow"]
    finally:
        engine.close()


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.floats(-5.0, 5.0, width=32), min_size=8, max_size=8),
    top_k=st.integers(0, 9),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2, 0.01]),
)
def test_filter_logits_is_transformers_top_k_then_top_p(logits, top_k, top_p):
    transformers = pytest.importorskip("transformers")
    scores = torch.tensor([logits])
    theirs = scores.clone()
    if top_k > 0:
        theirs = transformers.TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = transformers.TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(filter_logits(scores, top_k, top_p), theirs)


# -- a submission's requests of one prompt length are one batch --------------------------------------------


def same_length(tag, n, **spec):
    return [
        RolloutRequest(f"{tag}{i}", [1 + i % 5, 5, 7], SamplingSpec(max_new_tokens=6, seed=i, **spec)) for i in range(n)
    ]


def test_a_submission_of_one_prompt_length_runs_as_one_batch(model):
    sizes = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: sizes.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    try:
        engine = LocalEngine(model)  # no end token: every completion has 6 tokens
        engine.publish(0, model.state_dict())
        engine.submit(same_length("one", 8) + requests("other", n=2))  # prompt lengths 3 (x 8), 1, 2
    finally:
        hook.remove()
    assert len(engine.poll()) == 10
    # 6 draws of the batch of 8, then of each other prompt alone; one log-prob pass per total length
    assert sizes == [8] * 6 + [1] * 6 + [1] * 6 + [8, 1, 1]


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 5]),
    top_p=st.sampled_from([1.0, 0.9]),
    seed=st.integers(0, 2**20),
)
def test_a_batched_request_is_the_request_alone(model, lengths, temperature, top_k, top_p, seed):
    """Batching changes only the batch dimension of the forward passes. The same submission gives the same
    completions bitwise (its batches are a function of it); each equals the request submitted alone up to the
    rounding a batched kernel may add: no BLAS promises a row of a batch is rounded as alone (float32 ulps
    over the model's reductions, far under 1e-5 on these logits), so tokens must agree and log-probs within it."""
    spec = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    g = torch.Generator().manual_seed(seed)
    reqs = [
        RolloutRequest(
            f"b{i}", torch.randint(1, 32, (n,), generator=g).tolist(), SamplingSpec(6, seed=seed + i, **spec)
        )
        for i, n in enumerate(lengths)
    ]
    weights = shifted(model, 6)
    batched = reference(model, weights, reqs, 0)
    assert_same(reference(model, weights, reqs, 0), batched)
    for r, c in zip(reqs, batched):
        (alone,) = reference(model, weights, [r], 0)
        assert alone.completion_ids == c.completion_ids and alone.finish_reason == c.finish_reason
        torch.testing.assert_close(c.logps, alone.logps, rtol=0, atol=1e-5)
