"""A small decoder-only language model defined in the project (no downloads), for demos and tests.

>>> import torch
>>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
>>> model(torch.zeros(2, 5, dtype=torch.long)).shape
torch.Size([2, 5, 16])
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TinyLMConfig", "TinyLM", "byte_encode", "byte_decode"]


@attrs.frozen
class TinyLMConfig:
    """Sizes of a ``TinyLM``; the defaults make about 0.4M parameters over a byte vocabulary.

    >>> cfg = TinyLMConfig(d_model=8, n_layers=1)
    >>> cfg.vocab_size, cfg.to_dict()["model_type"], cfg.to_dict()["d_model"]
    (256, 'trainfold-tinylm', 8)
    >>> TinyLMConfig(d_model=-16)
    Traceback (most recent call last):
    ValueError: 'd_model' must be > 0: -16
    """

    vocab_size: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    d_model: int = attrs.field(default=96, validator=attrs.validators.gt(0))
    n_layers: int = attrs.field(default=3, validator=attrs.validators.gt(0))
    n_heads: int = attrs.field(default=4, validator=attrs.validators.gt(0))
    max_len: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    dropout: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)])

    def __attrs_post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}; change either")

    @property
    def pad_token_id(self) -> int:
        """The id ``train``'s default collator pads with: any id does, right padding is neither attended to (the
        attention is causal) nor scored (its labels are -100)."""
        return 0

    def to_dict(self) -> dict:
        """Return the config as plain JSON-ready values."""
        return {"model_type": "trainfold-tinylm", **attrs.asdict(self)}


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        p = self.drop.p if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class TinyLM(nn.Module):
    """A GPT-style causal LM: token and position embeddings, pre-norm blocks, a tied output head.

    ``forward(input_ids, attention_mask=None, inputs_embeds=None)`` returns logits shaped
    ``(batch, seq, vocab)``. Right padding needs no mask (attention is causal).

    >>> import torch
    >>> model = TinyLM(TinyLMConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_len=8))
    >>> list(model(torch.tensor([[1, 2, 3]])).shape), model.get_input_embeddings().weight.shape[0]
    ([1, 3, 16], 16)
    """

    def __init__(self, config: TinyLMConfig | None = None) -> None:
        super().__init__()
        cfg = config or TinyLMConfig()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model {cfg.d_model} must be divisible by n_heads {cfg.n_heads}")
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        """Return the token embedding (the HF name, so NEFTune finds it)."""
        return self.tok

    def forward(
        self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, inputs_embeds: Tensor | None = None
    ) -> Tensor:
        x = self.tok(input_ids) if inputs_embeds is None else inputs_embeds
        t = x.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"sequence of length {t} exceeds max_len {self.config.max_len}; truncate or enlarge")
        x = self.drop(x + self.pos(torch.arange(t, device=x.device)))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T


def byte_encode(text: str) -> list[int]:
    """Encode text as UTF-8 bytes: the byte-level vocabulary of ``TinyLM``.

    >>> byte_encode("hi")
    [104, 105]
    """
    return list(text.encode("utf-8"))


def byte_decode(ids: list[int]) -> str:
    """Decode byte ids back to text (invalid sequences become U+FFFD).

    >>> byte_decode([104, 105])
    'hi'
    """
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
