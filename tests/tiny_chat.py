"""A word-level tokenizer with a chat template and a tiny Llama over its vocabulary, built locally (no download):
what the SFT and DPO run tests give TRL's trainers and trainfold's runs alike."""

from __future__ import annotations

import torch
import transformers

WORDS = ["<pad>", "<s>", "</s>", "user:", "assistant:"] + [f"w{i}" for i in range(59)]


def word_tokenizer(template: str | None) -> transformers.PreTrainedTokenizerFast:
    """A fast tokenizer splitting on white space over ``WORDS`` (pad ``<pad>``, eos ``</s>``), with ``template``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    word = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word, pad_token="<pad>", eos_token="</s>")
    tok.chat_template = template
    return tok


def llama() -> transformers.LlamaForCausalLM:
    """A 2-layer Llama over ``WORDS``, its weights from seed 0."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)
