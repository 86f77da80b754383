"""What a command-line config builds: the ``[model]`` table's model and the ``[data]`` table's rows.

``python -m trainfold.cli train`` (``trainfold.cli.main``) reads the config (``trainfold.cli.config``) and
calls these; each raises ``ValueError`` naming the table, the value and the fix, which the command
line reports with every other problem of the config at once (exit 2, no traceback).
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any

__all__ = ["build_model", "build_data", "tokenizer_of", "length_problems"]


def build_model(spec: dict[str, Any]) -> Any:
    """Build the ``[model]`` table's model: random weights from a config, or pretrained ones by name or path."""
    kind = spec.get("type", "pretrained" if "name_or_path" in spec else "tinylm")
    if kind == "pretrained":
        if "name_or_path" not in spec:
            raise ValueError("[model] type 'pretrained' needs name_or_path (a local directory or a model name)")
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(spec["name_or_path"])
    if kind == "tinylm":
        from trainfold.core.models import TinyLM, TinyLMConfig

        return TinyLM(TinyLMConfig(**spec.get("config", {})))
    if kind == "hf":
        import transformers

        source = spec.get("config")
        settings = json.loads(Path(source).read_text()) if isinstance(source, str) else dict(source or {})
        config = transformers.AutoConfig.for_model(**settings)
        return transformers.AutoModelForCausalLM.from_config(config)
    raise ValueError(f"[model] type {kind!r} is not 'tinylm', 'hf' or 'pretrained'")


def build_data(spec: dict[str, Any], tokenizer: Any = None) -> tuple[Any, Any]:
    """Return ``(train_rows, eval_rows)`` from the ``[data]`` table: ``stdlib``, or a local file read by ``datasets``.

    Rows with ``input_ids`` are taken as they are; a ``text`` column (and a ``.txt`` file, as one document) is
    tokenized by ``tokenizer`` (the pretrained model's; bytes for ``tinylm``) and cut into ``seq_len`` rows.
    """
    from trainfold.cli.demo import byte_chunks, stdlib_text

    source, seq_len = spec.get("train", "stdlib"), int(spec.get("seq_len", 128))
    if seq_len < 1:
        raise ValueError(f"[data] seq_len must be a positive number of tokens, got {seq_len}")
    if _streams(source):
        return _stream_rows(spec, seq_len, tokenizer), None
    if source == "stdlib":
        rows: Any = byte_chunks(stdlib_text(int(spec.get("max_bytes", 1_500_000))), seq_len)
    else:
        rows = _file_rows(Path(source), seq_len, tokenizer)
    cut = len(rows) - max(1, int(len(rows) * float(spec.get("eval_fraction", 0.03))))
    if isinstance(rows, list):
        return rows[:cut], rows[cut:]
    return rows.select(range(cut)), rows.select(range(cut, len(rows)))


def _streams(source: str) -> bool:
    """A glob, or a list of files: streamed by ``trainfold.data.files`` (no eval split: ``[args]`` evaluates none)."""
    return not isinstance(source, str) or any(c in source for c in "*?[")


def _stream_rows(spec: dict[str, Any], seq_len: int, tokenizer: Any) -> Any:
    """The ``[data]`` glob as a streaming source: rows with ``input_ids`` as they are, a ``text`` row tokenized
    and cut to ``seq_len`` (each row on its own: a stream's position is a row's)."""
    from trainfold.data import files

    options = set(inspect.signature(files).parameters) - {"paths_or_glob"}  # [data] keys that are files()' own keywords
    source = files(spec["train"], **{k: v for k, v in spec.items() if k in options})
    names = sorted(next(source.rows(0))[1])  # the columns of the first row (one block read)
    if "input_ids" in names:
        return source
    if "text" not in names:
        raise ValueError(f"[data] {spec['train']!r}: rows need input_ids (token ids) or text; its columns: {names}")
    from trainfold.core.models import byte_encode

    encode = tokenizer or (lambda text: {"input_ids": byte_encode(text)})
    return source.map(functools.partial(_encoded, encode, seq_len))


def _encoded(encode: Any, seq_len: int, row: dict[str, Any]) -> dict[str, list[int]]:
    ids = list(encode(row["text"])["input_ids"])[:seq_len]
    return {"input_ids": ids, "labels": list(ids)}


_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _file_rows(path: Path, seq_len: int, tokenizer: Any) -> Any:
    """Load a local file with ``datasets`` (its builder by extension); tokenize a ``text`` column into rows."""
    if path.suffix not in _BUILDERS:
        raise ValueError(f"[data] train {str(path)!r}: the extension is not one of {sorted(_BUILDERS)} (or 'stdlib')")
    if not path.is_file():
        raise ValueError(f"[data] train {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        _check_json_lines(path)
    import datasets

    kw = {"sample_by": "document"} if path.suffix == ".txt" else {}
    rows = datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train", **kw)
    if "input_ids" in rows.column_names:
        return rows
    if "text" not in rows.column_names:
        raise ValueError(f"[data] {path}: rows need input_ids (token ids) or text; its columns: {rows.column_names}")
    from trainfold.core.models import byte_encode

    encode = tokenizer or (lambda text: {"input_ids": byte_encode(text)})

    def chunk(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        ids = [i for text in batch["text"] for i in encode(text)["input_ids"]]
        cut = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        return {"input_ids": cut, "labels": cut}

    return rows.map(chunk, batched=True, remove_columns=rows.column_names)


def _check_json_lines(path: Path) -> None:
    """Refuse a malformed ``.jsonl`` line by file, line and column (``datasets`` reports neither)."""
    found = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON row ({err.msg}, column {err.colno})") from None
            found += 1
    if not found:
        raise ValueError(
            f"{path} holds no rows (the file is empty or blank); write one JSON row per line, e.g. "
            '{"text": "..."} or {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}'
        )


def tokenizer_of(model_spec: dict[str, Any]) -> Any:
    """The pretrained model's tokenizer, loaded when a ``text`` column needs it; None: bytes (``tinylm``)."""
    if "name_or_path" not in model_spec:
        return None

    loaded: list[Any] = []  # the tokenizer, loaded on the first text (once, not per row)

    def encode(text: str) -> Any:
        if not loaded:
            import transformers

            loaded.append(transformers.AutoTokenizer.from_pretrained(model_spec["name_or_path"]))
        return loaded[0](text)

    return encode


def length_problems(model: Any, data_spec: dict[str, Any]) -> list[str]:
    """A ``seq_len`` longer than the model's positions (``max_len``, ``max_position_embeddings``)."""
    if "seq_len" not in data_spec and data_spec.get("train", "stdlib") != "stdlib":
        return []  # rows of a file keep their own lengths unless text is cut into seq_len rows
    config = getattr(model, "config", None)
    limit = getattr(config, "max_len", None) or getattr(config, "max_position_embeddings", None)
    seq_len = data_spec.get("seq_len", 128)
    if isinstance(limit, int) and isinstance(seq_len, int) and seq_len > limit:
        return [
            f"[data]: seq_len {seq_len} exceeds the model's {limit} positions; lower seq_len or raise [model] max_len"
        ]
    return []
