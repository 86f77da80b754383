"""`python -m trainfold.cli train`: the config formats, --set, --resume, and errors printed without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainfold import ckpt as checkpoint
from trainfold.cli.main import ConfigError, main, read_config, split_resume

ROOT = Path(__file__).resolve().parents[1]

TOML = """
[model]
type = "tinylm"
config = { d_model = 16, n_layers = 1, n_heads = 2, max_len = 32 }
[data]
train = "stdlib"
seq_len = 32
max_bytes = 20000
[args]
output_dir = "OUT"
max_steps = 2
per_device_train_batch_size = 4
save_strategy = "no"
report_to = ["jsonl"]
"""
PLAIN = {
    "model": {"type": "tinylm", "config": {"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 32}},
    "data": {"train": "stdlib", "seq_len": 32, "max_bytes": 20000},
    "args": {
        "output_dir": "OUT",
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "save_strategy": "no",
        "report_to": ["jsonl"],
    },
}
SOURCES = [("run.toml", TOML), ("run.json", json.dumps(PLAIN)), ("run.yaml", "YAML"), ("run.yml", "YAML")]
YAML = """
model: {type: tinylm, config: {d_model: 16, n_layers: 1, n_heads: 2, max_len: 32}}
data: {train: stdlib, seq_len: 32, max_bytes: 20000}
args:
  output_dir: OUT
  max_steps: 2
  per_device_train_batch_size: 4
  save_strategy: "no"
  report_to: [jsonl]
"""


def write(folder: Path, name: str, text: str, out: Path | None = None) -> Path:
    path = folder / name
    text = YAML if text == "YAML" else text
    path.write_text(text.replace("OUT", str(out or folder / "out")))
    return path


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trainfold.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# -- formats, help ---------------------------------------------------------------------------------


def tables(*argv: str) -> dict:
    """The config's three tables as the train command reads them (the unset [model]/[data] keys left out)."""
    config = read_config(list(argv))
    return {t: config[t] for t in ("model", "data", "args")}


def test_toml_json_and_yaml_configs_read_the_same(tmp_path):
    configs = [tables("--config", str(write(tmp_path, name, text))) for name, text in SOURCES]
    expected = json.loads(json.dumps(PLAIN).replace("OUT", str(tmp_path / "out")))
    expected["data"]["eval_fraction"] = 0.03  # the [data] table's default, filled in by the parser
    assert all(c == expected for c in configs)


def test_print_config_shows_the_merged_config_which_reads_back_the_same(tmp_path, capsys):
    config = str(write(tmp_path, "run.toml", TOML))
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", config, "--set", "args.max_steps=7", "--print_config"])
    assert done.value.code == 0
    printed = write(tmp_path, "printed.yaml", capsys.readouterr().out)
    assert tables("--config", str(printed)) == tables("--config", config, "--args.max_steps=7")
    assert tables("--config", str(printed))["args"]["max_steps"] == 7


def test_a_json_config_trains(tmp_path, capsys):
    config = write(tmp_path, "run.json", json.dumps(PLAIN))
    assert main(["train", "--config", str(config)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["status"] == "completed" and result["global_step"] == 2
    assert len((tmp_path / "out" / "log.jsonl").read_text().splitlines()) == 2  # the step-2 log and the summary


def test_help_documents_the_config_format_with_an_example(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for needle in (
        "TOML, JSON or YAML",
        "[model]",
        "[data]",
        "[args]",
        "Example (run.toml)",
        'type = "tinylm"',
        "--set args.max_steps=10",
        "--resume",
        "resume_from_checkpoint",
        "143",
    ):
        assert needle in text, needle


# -- --set -----------------------------------------------------------------------------------------


def test_set_overrides_nest_and_parse_literals(tmp_path):
    config = read_config(
        [
            "--config",
            str(write(tmp_path, "run.json", json.dumps(PLAIN))),
            "--set",
            "args.max_steps=10",
            "--set",
            "args.learning_rate=1e-3",
            "--set",
            'args.report_to=["jsonl"]',
            "--set=args.output_dir=runs/x",
            "--set",
            "args.disable_tqdm=true",
            "--set",
            "args.save_strategy=no",
            "--set",
            "args.eval_steps=null",
            "--set",
            "model.config.d_model=8",
            "--data.seq_len=16",  # jsonargparse's own spelling of the same
            "--set",
            "resume_from_checkpoint=true",
        ]
    )
    assert config["args"]["max_steps"] == 10 and config["args"]["learning_rate"] == 1e-3
    assert config["args"]["report_to"] == ["jsonl"] and config["args"]["output_dir"] == "runs/x"
    assert config["args"]["disable_tqdm"] is True and config["args"]["save_strategy"] == "no"  # not YAML's False
    assert config["args"]["eval_steps"] is None
    assert config["model"]["config"] == {**PLAIN["model"]["config"], "d_model": 8}
    assert config["data"]["seq_len"] == 16 and config["resume_from_checkpoint"] is True
    assert PLAIN["args"]["max_steps"] == 2


def test_a_set_after_the_config_wins_wherever_it_is_written(tmp_path):
    config = str(write(tmp_path, "run.toml", TOML))
    assert tables("--set", "args.max_steps=9", "--config", config)["args"]["max_steps"] == 9


def test_set_runs_with_the_override(tmp_path, capsys):
    config = write(tmp_path, "run.toml", TOML)
    assert (
        main(
            [
                "train",
                "--config",
                str(config),
                "--set",
                "args.max_steps=3",
                "--set",
                f"args.output_dir={tmp_path / 'other'}",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["global_step"] == 3
    assert (tmp_path / "other" / "log.jsonl").exists() and not (tmp_path / "out").exists()


def test_bad_set_items_are_named():
    with pytest.raises(ConfigError) as err:
        read_config(["--set", "max_steps=10", "--set", "args.max_steps", "--set", "learnig_rate=1"])
    text = str(err.value)
    assert "--set args.max_steps=..." in text and "must be key=value" in text
    assert "did you mean args.learning_rate?" in text


def test_a_value_of_the_wrong_type_for_a_typed_table_is_named(tmp_path):
    config = str(write(tmp_path, "run.toml", TOML))
    with pytest.raises(ConfigError, match=r"data\.seq_len"):
        read_config(["--config", config, "--set", "data.seq_len=long"])
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --model.layers=2"):
        read_config(["--config", config, "--set", "model.layers=2"])


# -- resume_from_checkpoint in the config ------------------------------------------------------------


def test_resume_from_checkpoint_is_taken_out_of_args_or_the_top_level():
    config = {"args": {"max_steps": 2, "resume_from_checkpoint": True}}
    assert split_resume(config) == ({"args": {"max_steps": 2}}, True) and "resume_from_checkpoint" in config["args"]
    assert split_resume({"resume_from_checkpoint": "ck", "args": {}}) == ({"args": {}}, "ck")
    with pytest.raises(ConfigError, match="set twice"):
        split_resume({"resume_from_checkpoint": "a", "args": {"resume_from_checkpoint": "b"}})
    with pytest.raises(ConfigError, match="must be true, false or a checkpoint path"):
        split_resume({"resume_from_checkpoint": 3, "args": {}})


def test_resume_in_the_config_continues_and_starts_fresh_when_there_is_nothing_yet(tmp_path, capsys):
    config = write(
        tmp_path,
        "run.toml",
        TOML.replace('save_strategy = "no"', 'save_strategy = "steps"\nsave_steps = 2')
        + "resume_from_checkpoint = true\n",
    )
    assert main(["train", "--config", str(config)]) == 0  # nothing to resume yet: step 0
    captured = capsys.readouterr()
    assert "no complete checkpoint" in captured.err and json.loads(captured.out.splitlines()[-1])["global_step"] == 2
    assert main(["train", "--config", str(config), "--set", "args.max_steps=4"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["global_step"] == 4
    assert checkpoint.read_metadata(checkpoint.latest_checkpoint(tmp_path / "out"))["step"] == 4


# -- errors: combined, no traceback, exit 2 ---------------------------------------------------------


def test_config_errors_are_printed_together_and_exit_2(tmp_path, capsys):
    bad = TOML.replace("max_steps = 2", 'max_steps = "x"\nlearnig_rate = 1').replace('"tinylm"', '"gpt"')
    assert main(["train", "--config", str(write(tmp_path, "run.toml", bad))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainfold train: error: ") and "did you mean 'learning_rate'" in err
    assert "[model]" in err and "'gpt'" in err
    wrong_type = write(tmp_path, "run2.toml", TOML.replace("max_steps = 2", 'max_steps = "x"'))
    assert main(["train", "--config", str(wrong_type)]) == 2
    assert "max_steps must be int, got 'x'" in capsys.readouterr().err
    for name, text, needle in [
        ("run.json", '{"args": ', "is not valid JSON"),
        ("run.ini", "", "extension '.ini'"),
        ("run3.toml", "[args\n", "is not valid TOML"),
        ("run4.toml", "[other]\nx = 1\n", "'other.x' is not accepted"),
        ("run5.json", '{"model": {}}', "required: args"),
    ]:
        assert main(["train", "--config", str(write(tmp_path, name, text))]) == 2
        assert needle in capsys.readouterr().err, name
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--config", str(write(tmp_path, "run6.toml", TOML)), "--resume", str(tmp_path / "nope")]) == 2
    assert "--resume" in capsys.readouterr().err


def test_a_bad_config_prints_no_traceback_in_a_real_process(tmp_path):
    done = cli("train", "--config", str(write(tmp_path, "run.json", '{"args": {"max_steps": 1, "lr": 1}')))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("trainfold train: error:") and "is not valid JSON" in done.stderr


# -- preempted, then --resume: bitwise the run that never stopped --------------------------------------


RESUMABLE = """
[model]
type = "tinylm"
config = { d_model = 16, n_layers = 1, n_heads = 2, max_len = 32, dropout = 0.1 }
[data]
train = "stdlib"
seq_len = 32
max_bytes = 20000
[args]
output_dir = "OUT"
max_steps = 120
per_device_train_batch_size = 4
gradient_accumulation_steps = 2
warmup_steps = 10
save_strategy = "steps"
save_steps = 120
enable_jit_checkpoint = true
logging_steps = 1
report_to = ["jsonl"]
"""


def one_thread_main(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``python -m trainfold.cli *argv`` run in this process, on one thread as the subprocesses: status, out, err."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    capfd.readouterr()
    try:
        status = main(list(argv))
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    return status, out, err


def test_sigterm_then_resume_continues_bitwise(tmp_path, capfd):
    """The stopped run is a process of its own (SIGTERM); the run that never stopped and the resume run here."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainfold.cli",
            "train",
            "--config",
            str(write(tmp_path, "b.toml", RESUMABLE, stopped)),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = stopped / "log.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 5):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    jit = checkpoint.latest_checkpoint(stopped)
    at = checkpoint.read_metadata(jit)["step"]
    assert 5 <= at < 120
    status, _, err = one_thread_main(capfd, "train", "--config", str(write(tmp_path, "a.toml", RESUMABLE, straight)))
    assert status == 0, err[-2000:]
    status, out, err = one_thread_main(capfd, "train", "--config", str(tmp_path / "b.toml"), "--resume")
    assert status == 0, err[-2000:]
    assert json.loads(out.splitlines()[-1])["global_step"] == 120
    assert f"step {at + 1}/120" in err and "step 1/120" not in err  # it continued
    for name in ("state.safetensors", "model.safetensors"):  # the record, and the params (held once, there)
        expected = load_file(straight / "checkpoint-120" / name)
        resumed = load_file(stopped / "checkpoint-120" / name)
        assert sorted(resumed) == sorted(expected)
        assert all((resumed[k] == expected[k]).all() for k in expected)
    logged = lambda out: [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = lambda out: {e["step"]: e["loss"] for e in logged(out) if "loss" in e}
    assert losses(stopped) == losses(straight)  # every step's logged loss, the resumed ones included


def test_the_config_reader_is_its_own_module_and_the_cli_uses_it(tmp_path):
    import trainfold.cli.main as cli
    from trainfold.cli import config as run_config

    assert cli.ConfigError is run_config.ConfigError and cli.read_config is run_config.read_config
    assert sorted(run_config.CONFIG_KINDS) == [".json", ".toml", ".yaml", ".yml"]
    with pytest.raises(run_config.ConfigError, match=r"has the extension '\.ini'; use one of \['\.json'"):
        run_config.read_config(["--config", str(write(tmp_path, "run.ini", TOML))])


# -- configuration errors exit 2 without a traceback; pretrained models and datasets' local files ---------


@pytest.mark.parametrize(
    "change, needle",
    [
        (("d_model = 16", "d_model = -16"), "[model]: 'd_model' must be > 0: -16"),
        (("seq_len = 32", "seq_len = 64"), "[data]: seq_len 64 exceeds the model's 32 positions; lower seq_len"),
        (
            ('train = "stdlib"', 'train = "ROWS"'),
            "rows.jsonl:2: not a JSON row (Expecting property name enclosed in double quotes, column 2)",
        ),
        (('train = "stdlib"', 'train = "data.xlsx"'), "the extension is not one of ['.csv', '.json'"),
    ],
)
def test_a_configuration_error_exits_2_naming_it(tmp_path, capsys, change, needle):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input_ids": [1, 2], "labels": [1, 2]}\n{input_ids: [1]}\n')
    config = write(tmp_path, "run.toml", TOML.replace(*change).replace("ROWS", str(rows)))
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainfold train: error: ") and needle in err and "Traceback" not in err


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_jsonl_file_exits_2_naming_it(tmp_path, capsys, content):
    rows = tmp_path / "rows.jsonl"  # was "[data]: StopIteration()"
    rows.write_text(content)
    config = write(tmp_path, "run.toml", TOML.replace('train = "stdlib"', f'train = "{rows}"'))
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"[data]: {rows} holds no rows (the file is empty or blank); write one JSON row per line, e.g. " in err


def tiny_pretrained(folder: Path) -> Path:
    """A tiny GPT-2 with a word-level tokenizer, written by save_pretrained (no download)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"])}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)
    config = transformers.GPT2Config(vocab_size=8, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_a_pretrained_model_fine_tunes_on_each_local_file_format(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    model = tiny_pretrained(tmp_path / "model")
    text = ["the cat sat on the mat", "a dog sat on a mat", "the dog sat on the cat"] * 4
    ids = [[1, 2, 3, 4], [6, 7, 3, 4]] * 6
    files = {
        "rows.jsonl": lambda p: p.write_text("\n".join(json.dumps({"input_ids": i, "labels": i}) for i in ids)),
        "rows.json": lambda p: p.write_text(json.dumps([{"text": t} for t in text])),
        "rows.csv": lambda p: datasets.Dataset.from_dict({"text": text}).to_csv(str(p)),
        "rows.parquet": lambda p: datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).to_parquet(str(p)),
        "rows.txt": lambda p: p.write_text("\n".join(text)),
    }
    for name, make in files.items():
        make(tmp_path / name)
        config = {
            "model": {"name_or_path": str(model)},
            "data": {"train": str(tmp_path / name), "seq_len": 4, "eval_fraction": 0.2},
            "args": {"output_dir": str(tmp_path / "out" / name), "max_steps": 2, "per_device_train_batch_size": 2}
            | {"save_strategy": "no", "report_to": "none", "disable_tqdm": True},
        }
        path = write(tmp_path, "run.json", json.dumps(config))
        assert main(["train", "--config", str(path)]) == 0, (name, capsys.readouterr().err)
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (result["status"], result["global_step"]) == ("completed", 2), name


def test_a_pretrained_model_that_is_not_there_is_a_configuration_error(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = write(tmp_path, "run.json", json.dumps({**PLAIN, "model": {"name_or_path": str(tmp_path / "none")}}))
    assert main(["train", "--config", str(config)]) == 2
    assert "[model]: " in capsys.readouterr().err


def test_under_torchrun_rank_0_alone_prints_the_result_line(tmp_path):
    from torchrun import torchrun_ok

    config = write(tmp_path, "run.toml", TOML.replace('report_to = ["jsonl"]', 'report_to = "none"'))
    done = torchrun_ok(ROOT / "src" / "trainfold" / "cli" / "__main__.py", "train", "--config", config, nproc=2)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["global_step"] == 2, done.stdout


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_the_command_imports_torch_ends_it_with_the_conventional_status(tmp_path, signum, status):
    """``-X importtime`` reports each import as it ends: once torch's is reported, the command is mid-import."""
    from resume_fixture import endless_cli_config

    config = endless_cli_config(tmp_path, tmp_path / "out")
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "trainfold.cli", "train", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        # both signals at their defaults: under `nohup`/`&` the tests inherit SIGINT ignored, which the command
        # keeps ignored (test_a_sigint_the_process_inherited_as_ignored_...), and the run would never end
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT)],
    )
    watchdog = threading.Timer(120, proc.kill)  # a run the signal did not end is killed: a failure, not a hang
    watchdog.start()
    try:
        for line in proc.stderr:
            if line.split("|")[-1].strip() == "torch":  # torch is imported inside main(), after its handlers
                proc.send_signal(signum)
                break
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == status, rest[-2000:]
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in rest and not (tmp_path / "out").exists()


def test_main_called_from_python_leaves_the_process_signal_handlers_as_it_found_them(tmp_path, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    config = tmp_path / "run.toml"
    config.write_text('[model]\ntype = "nope"\n[args]\noutput_dir = "out"\n')
    assert main(["train", "--config", str(config)]) == 2
    assert {s: signal.getsignal(s) for s in before} == before


# The command line's own entry point, then a teardown held open until stdin closes: the interpreter's teardown
# after a run (a second with torch loaded) made as long as the test needs to signal inside it.
HELD_TEARDOWN = """
import sys
from trainfold.cli.main import command
sys.argv = ["trainfold", "train", "--config", sys.argv[1]]
status = command()
sys.stdout.flush()
sys.stdin.read()
sys.exit(status)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_after_the_result_line_leaves_the_exit_status_0(tmp_path, signum):
    config = write(tmp_path, "run.toml", TOML.replace("max_steps = 2", "max_steps = 2\nenable_jit_checkpoint = true"))
    proc = subprocess.Popen(
        [sys.executable, "-c", HELD_TEARDOWN, str(config)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert json.loads(line)["status"] == "completed", line
        proc.send_signal(signum)  # the run is over and its result printed: the status must stay 0
        _, err = proc.communicate(input="", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]


# Runs the real command line in a process that inherited SIGINT as ignored (as `nohup ... &` leaves it); its
# run sends itself SIGINT once step 2 is logged (an observer added to train's call, nothing else changed).
INHERITED_SIGINT = """
import os, signal, sys
print("inherited", signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
import trainfold.trainer.train as trainer
from trainfold.cli.main import command
real = trainer.train

def interrupt(state, logs):
    if int(state.step) == 2:
        os.kill(os.getpid(), signal.SIGINT)

def train(*args, observers=(), **kwargs):
    return real(*args, observers=[*observers, interrupt], **kwargs)

trainer.train = train
sys.argv = ["trainfold", "train", "--config", sys.argv[1]]
sys.exit(command())
"""


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "no-jit"])
def test_a_sigint_the_process_inherited_as_ignored_does_not_preempt_the_run(tmp_path, jit):
    settings = f"max_steps = 4\nlogging_steps = 1\nenable_jit_checkpoint = {str(jit).lower()}"
    text = TOML.replace("max_steps = 2", settings)
    config = write(tmp_path, "run.toml", text)
    done = subprocess.run(
        [sys.executable, "-c", INHERITED_SIGINT, str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert done.stdout.startswith("inherited True"), done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["status"], result["global_step"]) == ("completed", 4)
    assert checkpoint.list_checkpoints(tmp_path / "out") == []  # no JIT checkpoint: nothing preempted it


def test_a_jit_run_in_a_process_that_ignores_both_signals_is_refused_by_name(tmp_path, capsys):
    config = write(tmp_path, "run.toml", TOML.replace("max_steps = 2", "max_steps = 2\nenable_jit_checkpoint = true"))
    before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert main(["train", "--config", str(config)]) == 2
        after = {s: signal.getsignal(s) for s in before}
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert after == {s: signal.SIG_IGN for s in before}  # as it found them
    err = capsys.readouterr().err
    assert "ignores both SIGTERM and SIGINT" in err and "enable_jit_checkpoint = false" in err, err
