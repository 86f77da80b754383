"""transformers' ``run_clm``, ``run_mlm`` and ``run_ner`` move to trainfold by changing only their import lines.

``tests/scripts/run_*.py`` make the calls the public scripts make, in their order (written here, never copied).
Each test runs the script's text as it is, with ``transformers.Trainer``, and the same text with only its
import lines changed (``from trainfold import Trainer``), on tiny local models and data, and compares the
per-step losses, the eval metrics, the outputs ``from_pretrained`` loads, and a resume.
"""

from __future__ import annotations

import difflib
import json
import re
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def migrated(name, into):
    """Write ``name``'s text into ``into`` twice: as it is, and with only its import lines changed (``Trainer``
    taken out of the ``from transformers import (...)`` block, ``from trainfold import Trainer`` after it)."""
    text = (SCRIPTS / f"{name}.py").read_text()
    block = re.search(r"^from transformers import \(\n(?:    .*\n)*\)\n", text, flags=re.M)
    assert block is not None and "    Trainer,\n" in block.group(0), name
    moved = block.group(0).replace("    Trainer,\n", "") + "from trainfold import Trainer\n"
    ours = text.replace(block.group(0), moved)
    into.mkdir(parents=True, exist_ok=True)
    (into / f"hf_{name}.py").write_text(text)
    (into / f"trainfold_{name}.py").write_text(ours)
    return text, ours


def changed_lines(before, after):
    """``diff -u before after | grep -c '^[-+][^-+]'``."""
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="")
    return sum(1 for line in diff if re.match(r"^[-+][^-+]", line))


def run(path, argv, monkeypatch):
    """Run the script at ``path`` as ``python path argv...`` does."""
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    runpy.run_path(str(path), run_name="__main__")


def history(out):
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def step_losses(out):
    return [e["loss"] for e in history(out) if "loss" in e]


def results(out, split):
    metrics = json.loads((out / f"{split}_results.json").read_text())
    return {k: v for k, v in metrics.items() if not any(s in k for s in ("runtime", "per_second", "_token_loss"))}


def common_argv(out, *extra):
    argv = ["--output_dir", str(out), "--do_train", "--do_eval", "--max_steps", "4", "--learning_rate", "1e-2"]
    argv += ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "3", "--logging_steps", "1"]
    argv += ["--save_steps", "2", "--seed", "3", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true"]
    return [*argv, "--eval_strategy", "steps", "--eval_steps", "2", *extra]


def sentences(n, seed, lo=3, hi=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 59, (k,), generator=g)) for k in lengths]


def check_script_migrates(tmp_path, monkeypatch, name, argv_for, *, same_eval=True):
    """Run ``name`` both ways, then resume the trainfold run from its first checkpoint; return both outputs."""
    text, ours = migrated(name, tmp_path / "scripts")
    assert changed_lines(text, ours) <= 4
    outs = {}
    for who in ("hf", "trainfold"):
        outs[who] = tmp_path / who
        with monkeypatch.context() as patch:
            run(tmp_path / "scripts" / f"{who}_{name}.py", argv_for(outs[who]), patch)
    hf, tf = outs["hf"], outs["trainfold"]
    assert len(step_losses(tf)) == 4
    assert step_losses(tf) == step_losses(hf)  # bitwise: the same batches, the same float32 means
    assert results(tf, "eval").keys() == results(hf, "eval").keys()
    if same_eval:
        hf_evals = [e["eval_loss"] for e in history(hf) if "eval_loss" in e]
        assert [e["eval_loss"] for e in history(tf) if "eval_loss" in e] == pytest.approx(hf_evals, rel=1e-5)
        assert results(tf, "eval") == pytest.approx(results(hf, "eval"), rel=1e-5)
    assert results(tf, "train").keys() == results(hf, "train").keys()
    for f in ("all_results.json", "README.md", "config.json", "model.safetensors", "tokenizer.json"):
        assert (tf / f).is_file(), f
    assert (
        transformers.AutoTokenizer.from_pretrained(tf).pad_token
        == transformers.AutoTokenizer.from_pretrained(hf).pad_token
    )
    # resume: the second half again from checkpoint-2, into the same output_dir
    whole = step_losses(tf)
    shutil.rmtree(tf / "checkpoint-4")
    run(
        tmp_path / "scripts" / f"trainfold_{name}.py",
        [*argv_for(tf), "--resume_from_checkpoint", str(tf / "checkpoint-2")],
        monkeypatch,
    )
    assert step_losses(tf) == whole
    return hf, tf


# -- run_clm ---------------------------------------------------------------------------------------------------------


def test_run_clm_moves_by_its_import_with_the_trainers_losses_eval_outputs_and_resume(tmp_path, monkeypatch):
    from tiny_chat import llama, word_tokenizer

    model_dir = tmp_path / "model"
    llama().save_pretrained(model_dir)
    word_tokenizer(None).save_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(sentences(24, 0)) + "\n")
    (data / "validation.txt").write_text("\n".join(sentences(9, 1)) + "\n")

    def argv(out):
        files = ["--train_file", str(data / "train.txt"), "--validation_file", str(data / "validation.txt")]
        return ["--model_name_or_path", str(model_dir), *files, "--block_size", "8", *common_argv(out)]

    hf, tf = check_script_migrates(tmp_path, monkeypatch, "run_clm", argv)
    assert "perplexity" in results(tf, "eval") and "eval_accuracy" in results(tf, "eval")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tf)
    assert loaded.config.vocab_size == 64


# -- run_mlm ---------------------------------------------------------------------------------------------------------

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_tokenizer():
    """A fast word-level tokenizer over ``w0``..``w58`` that wraps each text in ``[CLS] ... [SEP]``, as BERT's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(SPECIAL + [f"w{i}" for i in range(59)])}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    names = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, **names)


def bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw,
    )  # fmt: skip


def test_run_mlm_moves_by_its_import_with_the_trainers_masks_and_losses_and_resumes(tmp_path, monkeypatch):
    """``DataCollatorForLanguageModeling`` masks with the global generators, which ``Trainer(...)`` seeds with
    ``args.seed``; torch's ``DataLoader`` draws its workers' base seed from them whenever an epoch (or an evaluation)
    starts iterating, and trainfold's stream draws that number too: the per-step losses are bitwise HF's (no
    dropout: trainfold draws dropout from the run's seed, HF from the global generator). Training stops mid-epoch,
    where accelerate's loader has collated the next batch ahead; the stream has too, so the eval masks and
    metrics are HF's as well."""
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    transformers.BertForMaskedLM(bert_config()).save_pretrained(model_dir)
    bert_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(sentences(24, 0)) + "\n")
    (data / "validation.txt").write_text("\n".join(sentences(9, 1)) + "\n")

    def argv(out):
        files = ["--train_file", str(data / "train.txt"), "--validation_file", str(data / "validation.txt")]
        argv = ["--model_name_or_path", str(model_dir), *files, "--max_seq_length", "16", *common_argv(out)]
        return [*argv, "--eval_strategy", "no"]  # run_mlm's default: evaluate once, after training

    hf, tf = check_script_migrates(tmp_path, monkeypatch, "run_mlm", argv)
    assert "perplexity" in results(tf, "eval") and "eval_accuracy" in results(tf, "eval")
    assert transformers.AutoModelForMaskedLM.from_pretrained(tf).config.vocab_size == 64


@pytest.mark.parametrize(
    "extra",
    [
        {"eval_strategy": "steps", "eval_steps": 5, "max_steps": 15},  # mid-epoch, and across the epoch's end
        {"eval_strategy": "steps", "eval_steps": 4, "max_steps": 14},  # and at the epoch's end: nothing ahead
        {"eval_strategy": "no", "max_steps": 5},  # stop mid-epoch, then evaluate
    ],
    ids=["evaluating", "at_epoch_end", "max_steps"],
)
def test_mlm_masks_around_a_mid_epoch_evaluation_are_the_trainers(tmp_path, extra):
    """accelerate's loader has collated the epoch's next micro-batch before it yields one; trainfold's stream
    collates ahead too, so a ``DataCollatorForLanguageModeling`` draws the same masks before and after an
    evaluation in the middle of an epoch: per-step losses bitwise, eval losses equal to ``transformers.Trainer``'s."""
    import trainfold

    tokenizer = bert_tokenizer()
    rows = [dict(tokenizer(s)) for s in sentences(24, 0)]
    eval_rows = [dict(tokenizer(s)) for s in sentences(9, 1)]
    logs = {}
    for who, trainer_class in (("hf", transformers.Trainer), ("trainfold", trainfold.Trainer)):
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(bert_config())
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / who), per_device_train_batch_size=2, per_device_eval_batch_size=3,
            learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=3, report_to="none", use_cpu=True,
            disable_tqdm=True, **extra,
        )  # fmt: skip
        collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
        trainer = trainer_class(
            model=model, args=args, train_dataset=rows, eval_dataset=eval_rows, data_collator=collator
        )
        trainer.train()
        final = trainer.evaluate()["eval_loss"]
        history = trainer.state.log_history
        losses = [(e["step"], e["loss"]) for e in history if "loss" in e]
        evals = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
        logs[who] = losses, evals, final
    (hf_losses, hf_evals, hf_final), (tf_losses, tf_evals, tf_final) = logs["hf"], logs["trainfold"]
    assert len(tf_losses) == extra["max_steps"]
    assert tf_losses == hf_losses  # bitwise: the same masks
    assert [s for s, _ in tf_evals] == [s for s, _ in hf_evals]
    assert [v for _, v in tf_evals] == pytest.approx([v for _, v in hf_evals], rel=1e-5)
    assert tf_final == pytest.approx(hf_final, rel=1e-5)


def test_mlm_collations_with_accumulation_are_the_trainers_one_by_one(tmp_path):
    """With gradient accumulation (and an epoch's last step of one micro-batch), evaluations every 2 steps and a
    ``max_steps`` stop mid-epoch, then ``evaluate()``: every collation, training's and evaluation's, in order, draws
    the masks of ``transformers.Trainer``'s (HF's logged loss under accumulation is another quantity)."""
    import trainfold

    tokenizer = bert_tokenizer()
    rows = [dict(tokenizer(s)) for s in sentences(22, 0)]  # 11 micro-batches an epoch: 6 steps, the last of one
    eval_rows = [dict(tokenizer(s)) for s in sentences(9, 1)]

    class Recording(transformers.DataCollatorForLanguageModeling):
        def __call__(self, features, *rest, **kw):
            out = super().__call__(features, *rest, **kw)
            self.masks.append(out["labels"].tolist())
            return out

    masks = {}
    for who, trainer_class in (("hf", transformers.Trainer), ("trainfold", trainfold.Trainer)):
        torch.manual_seed(0)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / who), per_device_train_batch_size=2, per_device_eval_batch_size=3,
            gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=3,
            eval_strategy="steps", eval_steps=2, max_steps=9, report_to="none", use_cpu=True, disable_tqdm=True,
        )  # fmt: skip
        collator = Recording(tokenizer, mlm_probability=0.3)
        collator.masks = []
        model = transformers.BertForMaskedLM(bert_config())
        trainer = trainer_class(
            model=model, args=args, train_dataset=rows, eval_dataset=eval_rows, data_collator=collator
        )
        trainer.train()
        trainer.evaluate()
        masks[who] = collator.masks
    assert len(masks["trainfold"]) == len(masks["hf"])  # 9 steps: 17 micro-batches and the 18th ahead; the evals
    assert masks["trainfold"] == masks["hf"]


# -- run_ner ---------------------------------------------------------------------------------------------------------


def tagged(n, seed):
    g = torch.Generator().manual_seed(seed)
    tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    rows = []
    for words in sentences(n, seed, 2, 12):
        split = words.split()
        rows.append(
            {"tokens": split, "ner_tags": [tags[int(t)] for t in torch.randint(0, 5, (len(split),), generator=g)]}
        )
    return rows


def test_run_ner_moves_by_its_import_with_the_trainers_losses_eval_loss_predictions_and_resume(tmp_path, monkeypatch):
    """Rows of 2 to 11 words in eval batches of 3, 3 and 1: ``eval_loss`` is HF's row-weighted batch means."""
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    transformers.BertForMaskedLM(bert_config()).save_pretrained(model_dir)
    bert_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    for split, rows in (("train", tagged(16, 0)), ("validation", tagged(7, 1)), ("test", tagged(5, 2))):
        (data / f"{split}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def argv(out):
        files = [f"--{s}_file" for s in ("train", "validation", "test")]
        files = [x for f in files for x in (f, str(data / f"{f[2:-5]}.json"))]
        return ["--model_name_or_path", str(model_dir), *files, "--do_predict", *common_argv(out)]

    hf, tf = check_script_migrates(tmp_path, monkeypatch, "run_ner", argv)
    assert results(tf, "predict") == pytest.approx(results(hf, "predict"), rel=1e-5)
    assert (tf / "predictions.txt").read_text() == (hf / "predictions.txt").read_text()
    loaded = transformers.AutoModelForTokenClassification.from_pretrained(tf)
    assert loaded.config.id2label == {0: "B-LOC", 1: "B-PER", 2: "I-LOC", 3: "I-PER", 4: "O"}
