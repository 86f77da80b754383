"""A collator drawing from the global generators (torch's, numpy's, ``random``'s) continues its draws across a
resume: ``train`` saves their states with each checkpoint and restores them before the first collation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from trainfold.core.rng import global_rng_states
from trainfold.data.collate import PadCollate
from trainfold.trainer.args import TrainingArguments
from trainfold.trainer.train import train

_VOCAB = {"[PAD]": 0, "[MASK]": 1, "[UNK]": 2, **{f"t{i}": i for i in range(3, 32)}}


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    word = Tokenizer(models.WordLevel(vocab=_VOCAB, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=word, pad_token="[PAD]", mask_token="[MASK]", unk_token="[UNK]"
    )


def _bert() -> transformers.BertForMaskedLM:
    torch.manual_seed(0)  # as a script's set_seed: the collator then draws from this generator
    cfg = transformers.BertConfig(
        vocab_size=len(_VOCAB),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(cfg)


def _rows(n: int = 24) -> list[dict[str, list[int]]]:
    return [{"input_ids": [3 + (i * 7 + j) % 29 for j in range(4 + i % 5)]} for i in range(n)]


class _Augmenting:
    """An augmenting collator drawing from numpy's and ``random``'s global generators: it masks two random
    positions of each row, so its draws change what the model sees."""

    def __init__(self) -> None:
        self.pad = PadCollate()

    def __call__(self, items: list[dict]) -> dict:
        out = []
        for item in items:
            ids = list(item["input_ids"])
            ids[random.randrange(len(ids))] = 1  # [MASK]
            ids[int(np.random.randint(len(ids)))] = 1
            out.append({"input_ids": ids, "labels": list(item["input_ids"])})
        return self.pad(out)


def _run(out, collator, *, stop=None, resume=None, **extra):
    np.random.seed(0)
    random.seed(0)
    model = _bert()
    args = TrainingArguments(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
        report_to="none", disable_tqdm=True, save_steps=3, seed=0, **extra,
    )  # fmt: skip
    eval_rows = _rows(4) if extra.get("eval_strategy") == "steps" else None
    result = train(model, args, _rows(), eval_rows, data_collator=collator, stop=stop, resume_from_checkpoint=resume)
    return result, model


def _losses(result):
    return [(e["step"], e["loss"]) for e in result.log_history if "loss" in e]


COLLATORS = {
    "mlm": lambda: transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=True, mlm_probability=0.3),
    "numpy+random": _Augmenting,
}


@pytest.mark.parametrize(
    "extra",
    [{}, {"eval_strategy": "steps", "eval_steps": 3}, {"dataloader_num_workers": 1}],
    ids=["plain", "evaluating", "workers"],
)
@pytest.mark.parametrize("kind", sorted(COLLATORS))
def test_a_stop_and_resume_equals_the_uninterrupted_run_bitwise(tmp_path, kind, extra):
    whole, whole_model = _run(tmp_path / "whole", COLLATORS[kind](), **extra)
    _run(tmp_path / "parts", COLLATORS[kind](), stop=lambda s: int(s.step) >= 3, **extra)
    resumed, resumed_model = _run(tmp_path / "parts", COLLATORS[kind](), resume=True, **extra)
    assert resumed.global_step == 6
    assert _losses(resumed) == _losses(whole)
    for (name, a), b in zip(whole_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_checkpoint_holds_the_generators_as_json(tmp_path):
    import json

    _run(tmp_path, COLLATORS["mlm"](), stop=lambda s: int(s.step) >= 3)
    sidecar = next(tmp_path.glob("checkpoint-3/*.json"))
    metadata = json.loads(sidecar.read_text())["metadata"]
    saved, ahead = metadata["global_rng"], metadata["global_rng_ahead"]
    assert sorted(saved) == sorted(ahead) == ["0"]
    assert sorted(saved["0"]) == sorted(ahead["0"]) == sorted(global_rng_states())
    # the states before the look-ahead collation of step 4's first micro-batch, and after it
    assert ahead["0"]["torch"] != saved["0"]["torch"]
