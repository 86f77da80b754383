"""Packing and padding-free batches: TRL's bins, transformers' flattening, and the unpacked step's gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import EPS, assert_within, causal_lm_run_bounds, causal_lm_step_abs_grads, grad_atol, reordered

from trainfold import init_state, make_step, sgd
from trainfold.core.losses import causal_lm
from trainfold.core.models import TinyLM, TinyLMConfig
from trainfold.data import pad_collate
from trainfold.data.packing import check_packable, pack, packed_collate, padding_free_collate

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")


def documents(lengths: list[int], seed: int = 0, vocab: int = 64) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        labels = list(ids)
        labels[: min(2, n)] = [-100] * min(2, n)  # a prompt that is no target
        rows.append({"input_ids": ids, "labels": labels})
    return rows


# -- the bins are TRL's ----------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=30), st.integers(1, 10), st.booleans(), st.integers(1, 8))
def test_bins_are_those_of_trl_pack_dataset(lengths, max_length, truncate, window):
    datasets.disable_progress_bars()
    rows = [{"input_ids": list(range(100 * i, 100 * i + n))} for i, n in enumerate(lengths)]
    ours = pack(rows, max_length, truncate=truncate, window=window)
    theirs = trl.data_utils.pack_dataset(
        datasets.Dataset.from_list(rows),
        max_length,
        strategy="bfd" if truncate else "bfd_split",
        map_kwargs={"batch_size": window},
    )
    assert [r["input_ids"] for r in ours] == theirs["input_ids"]
    starts = [[i for i, p in enumerate(r["position_ids"]) if p == 0] for r in ours]
    lens = [[b - a for a, b in zip(s, s[1:] + [len(r["input_ids"])])] for s, r in zip(starts, ours)]
    assert lens == theirs["seq_lengths"]


def test_empty_rows_are_dropped():
    assert [r["input_ids"] for r in pack([{"input_ids": []}, {"input_ids": [3]}, {"input_ids": []}], 4)] == [[3]]


def test_labels_default_to_the_inputs_and_each_document_starts_without_a_target():
    (row,) = pack([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 4]}], max_length=8)
    assert row["input_ids"] == [5, 6, 7, 8, 9]
    assert row["labels"] == [-100, 6, 7, -100, 4]
    assert row["position_ids"] == [0, 1, 2, 0, 1]


def test_padding_free_batches_equal_transformers_flattening():
    rows = documents([4, 1, 6])
    ours = padding_free_collate()(rows)
    theirs = transformers.DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)(rows)
    for key in ("input_ids", "labels", "position_ids"):
        assert ours[key].tolist() == theirs[key].tolist()
    assert "attention_mask" not in ours and "use_cache" not in ours  # the step and evaluation turn the cache off


def test_padding_free_batches_have_exactly_trls_keys_and_values():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = documents([4, 1, 6])
    ours = padding_free_collate()(rows)
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


# -- a packed step is the unpacked step --------------------------------------------------------------


def llama(attn: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg)  # use_cache=True, as shipped: the step and evaluation turn it off


def padded(model):
    """``model`` with a pad id: unpacked documents of several lengths are padded (the default collator refuses
    without one, as transformers.Trainer's)."""
    model.config.pad_token_id = 0
    return model


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"llama-sdpa": lambda: llama("sdpa"), "llama-eager": lambda: llama("eager"), "gpt2": gpt2}


def test_evaluating_padding_free_batches_gives_the_padded_loss_with_the_cache_on_in_the_config():
    """Evaluation runs with use_cache=False (TRL's compute_loss passes it): a KV cache would drop the per-document
    masks of the flattened row and let documents attend to each other."""
    from trainfold.evaluation import evaluate_batches as evaluate

    model, docs = llama("sdpa"), documents([5, 3, 6, 2])
    assert model.config.use_cache
    padded = evaluate(model, None, [pad_collate()(docs)], speed_metrics=False)["eval_loss"]
    flat_batch = padding_free_collate()(docs)
    flat = evaluate(model, None, [flat_batch], speed_metrics=False)["eval_loss"]
    assert flat == pytest.approx(padded, rel=1e-5)  # the same token terms, float32 sums in another order
    with torch.no_grad():  # the cache on: the documents see each other, and the loss moves
        logits = model(**{k: v for k, v in flat_batch.items() if k != "labels"}, use_cache=True).logits
    leaked = causal_lm(logits, flat_batch["labels"], causal_lm.count_items(flat_batch["labels"])).item()
    assert leaked != pytest.approx(padded, rel=1e-3)


def one_step(model, batch):
    opt = sgd(1.0)
    return make_step(model, causal_lm, opt)(init_state(model, opt), batch)


def assert_same_update(a, b, model, padded):
    """``b`` is ``a``'s step on the same documents laid out otherwise (``padded``: ``a``'s micro-batches).

    The same token terms added in other orders (tests/tolerance.py): each gradient within ``grad_atol`` of
    the padded rows' measured sizes, which SGD at lr 1.0 moves the params by, rounded once (EPS |p|); the
    loss adds its positive token terms in another order.
    """
    assert int(a.metrics["num_items"]) == int(b.metrics["num_items"])
    opt = sgd(1.0)
    sizes, terms = causal_lm_step_abs_grads(model, padded, init_state(model, opt).params)
    torch.testing.assert_close(a.metrics["loss"], b.metrics["loss"], rtol=reordered(terms, 1.0), atol=0)
    atol = grad_atol(sizes, terms)
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k], rtol=EPS, atol=atol[k])


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(st.integers(3, 12), min_size=2, max_size=6), seed=st.integers(0, 9))
def test_a_packed_step_equals_the_padded_step_on_the_same_documents(name, lengths, seed):
    model = MODELS[name]()
    docs = documents(lengths, seed)
    padded = one_step(model, [pad_collate()(docs)])
    packed = one_step(model, [packed_collate()(pack(docs, max_length=16))])
    assert_same_update(padded, packed, model, [pad_collate()(docs)])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_padding_free_step_with_accumulation_equals_the_padded_step(name):
    model = MODELS[name]()
    docs = documents([5, 9, 2, 7, 3], seed=4)
    padded = one_step(model, [pad_collate()(docs[:3]), pad_collate()(docs[3:])])
    flat = one_step(model, [padding_free_collate()(docs[:2]), padding_free_collate()(docs[2:])])
    assert_same_update(padded, flat, model, [pad_collate()(docs[:3]), pad_collate()(docs[3:])])


# -- refusals --------------------------------------------------------------------------------------


def test_models_that_cannot_keep_documents_apart_are_refused():
    with pytest.raises(ValueError, match="forward takes position_ids"):
        check_packable(TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8)))
    check_packable(llama("sdpa"))


def test_rows_that_cannot_be_packed_exactly_are_refused():
    with pytest.raises(ValueError, match="row 1 has padding inside"):
        pack([{"input_ids": [1, 2]}, {"input_ids": [1, 2], "attention_mask": [1, 0]}], 4)
    with pytest.raises(ValueError, match="column 'labels' has 1 entries"):
        pack([{"input_ids": [1, 2], "labels": [3]}], 4)
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        pack([{"input_ids": [1]}], 0)
    with pytest.raises(KeyError, match="has no position_ids"):
        packed_collate()([{"input_ids": [1, 2]}])


def test_text_and_length_columns_do_not_survive_packing():
    (row,) = pack([{"input_ids": [1, 2], "text": "ab", "length": 2, "attention_mask": [1, 1]}], 4)
    assert sorted(row) == ["input_ids", "labels", "position_ids"]


# -- through train ---------------------------------------------------------------------------------


def run_args(out, **changes):
    from trainfold import TrainingArguments

    settings = dict(
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        seed=3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        disable_tqdm=True,
    )
    return TrainingArguments(**{**settings, **changes})


LM_SETTINGS = {
    "packing": dict(packing=True, max_length=24),
    "packing-split": dict(packing=True, max_length=24, packing_strategy="bfd_split"),
    "padding-free": dict(padding_free=True),
    "packing-padding-free": dict(packing=True, max_length=24, padding_free=True),
    "chunked": dict(loss_chunk_size=5),
}


@pytest.mark.parametrize("name", sorted(LM_SETTINGS))
def test_llm_settings_train_and_resume_bitwise(name, tmp_path):
    from trainfold import train

    docs = documents([3 + (7 * i) % 19 for i in range(40)], seed=5)
    settings = LM_SETTINGS[name]
    straight = train(padded(llama("sdpa")), run_args(tmp_path / "straight", **settings), docs)
    assert straight.status == "completed" and straight.global_step == 6
    out = tmp_path / "stopped"
    first = train(padded(llama("sdpa")), run_args(out, **settings), docs, stop=lambda s: int(s.step) >= 3)
    assert first.global_step == 3
    resumed = train(padded(llama("sdpa")), run_args(out, **settings), docs, resume_from_checkpoint=True)
    for k, v in straight.state.params.items():
        assert torch.equal(v, resumed.state.params[k]), k


def test_the_chunked_loss_trains_like_the_plain_one(tmp_path):
    from trainfold import train

    docs = documents([3 + (5 * i) % 17 for i in range(30)], seed=6)
    linear = {"save_strategy": "no", "optim": "sgd", "optim_args": "momentum=0.9"}  # see tests/tolerance.py
    plain = train(padded(llama("sdpa")), run_args(tmp_path / "plain", **linear), docs)
    chunked = train(padded(llama("sdpa")), run_args(tmp_path / "chunked", loss_chunk_size=7, **linear), docs)
    # the chunks add the head's token terms in another order: within the bound of SGD + momentum runs
    args = run_args(tmp_path)
    bound, rtol, loss_atol = causal_lm_run_bounds(
        llama("sdpa"), docs, 4, plain.log_history, args.learning_rate, 0.9, max_norm=args.max_grad_norm
    )
    for k, v in plain.state.params.items():
        assert_within(chunked.state.params[k], v, bound[k], rtol, k)
    a = [h["loss"] for h in plain.log_history if "loss" in h]
    b = [h["loss"] for h in chunked.log_history if "loss" in h]
    assert len(a) == len(b) and all(y == pytest.approx(x, abs=loss_atol(x), rel=0) for x, y in zip(a, b))


def test_llm_settings_refuse_what_they_cannot_do_exactly(tmp_path):
    from trainfold import TrainingArguments, train

    docs = documents([4, 5, 6, 7])
    with pytest.raises(ValueError, match="packing_strategy='wrapped' is not supported: it cuts documents"):
        TrainingArguments(packing=True, packing_strategy="wrapped")
    with pytest.raises(ValueError, match="neftune_noise_alpha scales its noise"):
        TrainingArguments(padding_free=True, neftune_noise_alpha=5.0)
    with pytest.raises(ValueError, match="loss_chunk_size must be >= 0"):
        TrainingArguments(loss_chunk_size=-1)
    with pytest.raises(ValueError, match="drop data_collator"):
        train(llama("sdpa"), run_args(tmp_path / "a", packing=True), docs, data_collator=pad_collate())
    with pytest.raises(ValueError, match="cannot apply compute_loss_func"):
        train(llama("sdpa"), run_args(tmp_path / "b", loss_chunk_size=8), docs, compute_loss_func=causal_lm)
    with pytest.raises(ValueError, match="forward takes position_ids"):
        tiny = TinyLM(TinyLMConfig(vocab_size=64, d_model=8, n_layers=1, n_heads=2, max_len=32))
        train(tiny, run_args(tmp_path / "c", packing=True), docs)
