"""GRPO's rollouts through a vLLM server (``trainfold.rollout.VLLMEngine``): publish time and generation speed.

A Llama (``--hidden`` × ``--layers``, random weights) is saved and served by ``vllm serve`` on GPU 0 (NCCL weight
transfer, ``--load-format dummy``: every weight it uses comes from a publish); the trainer side runs on GPU 1. Each
round publishes the trainer's weights as a new version (seconds per 100 MB of weights: vLLM's transfer group is
its own, so no plain broadcast stands beside it; ``benchmarks/rollout_publish.py`` has that ratio), then submits
``--requests`` prompts of ``--prompt`` tokens for ``--completion`` new tokens each and polls them all: completion
tokens per second. Needs vllm and two CUDA GPUs; elsewhere it says so and exits 0 (``benchmarks/gpu.py`` runs it).

    python benchmarks/vllm_rollout.py
    python benchmarks/vllm_rollout.py --hidden 1024 --layers 8 --requests 256
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import tempfile
import time

SKIP = "vLLM part skipped: needs vllm and 2 CUDA GPUs (server on GPU 0, trainer on GPU 1)"


def available() -> bool:
    import torch

    return importlib.util.find_spec("vllm") is not None and torch.cuda.device_count() >= 2


def _serve(path: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0"}
    command = ["vllm", "serve", path, "--port", str(port), "--load-format", "dummy", "--skip-tokenizer-init",
               "--max-model-len", "2048", "--gpu-memory-utilization", "0.5",
               "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs"]  # fmt: skip
    return subprocess.Popen(command, env=env)


def _wait_healthy(port: int, server: subprocess.Popen, timeout_s: float = 900) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode} before it was healthy")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vllm serve was not healthy after {timeout_s}s")


def run(ns: argparse.Namespace) -> list[dict[str, float]]:
    """Serve, then measure ``ns.rounds`` rounds of publish + generate; return one row per round."""
    import torch
    import transformers

    from trainfold.rollout import RolloutRequest, SamplingSpec
    from trainfold.rollout.vllm import VLLMEngine

    eos = 2
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=ns.hidden, intermediate_size=4 * ns.hidden, num_hidden_layers=ns.layers,
        num_attention_heads=max(1, ns.hidden // 64), num_key_value_heads=max(1, ns.hidden // 64),
        max_position_embeddings=2048, eos_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    rows = []
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        server = _serve(path, ns.port)
        try:
            _wait_healthy(ns.port, server)
            torch.cuda.set_device(1)
            model = model.to("cuda:1")
            engine = VLLMEngine(f"http://127.0.0.1:{ns.port}", path, eos_token_id=eos, pause_mode="keep")
            try:
                for version in range(ns.rounds + 1):  # round 0 warms up (NCCL group, CUDA graphs): not counted
                    begun = time.perf_counter()
                    engine.publish(version, model.state_dict())
                    torch.cuda.synchronize()
                    published = time.perf_counter() - begun
                    spec = SamplingSpec(max_new_tokens=ns.completion, seed=version)
                    prompt = [3 + i % 100 for i in range(ns.prompt)]
                    reqs = [RolloutRequest(f"v{version}-{i}", prompt, spec) for i in range(ns.requests)]
                    begun = time.perf_counter()
                    engine.submit(reqs)
                    done = engine.poll(min_items=len(reqs))
                    generated = time.perf_counter() - begun
                    tokens = sum(len(c.completion_ids) for c in done)
                    if version:
                        rows.append({"publish_s_per_100mb": published * 100 / mb, "tokens_per_s": tokens / generated})
            finally:
                engine.close()
        finally:
            server.terminate()
            server.wait(timeout=120)
    print(f"Llama {ns.hidden} x {ns.layers} layers ({mb:.0f} MB bf16), {ns.requests} requests of {ns.prompt} prompt "
          f"tokens, {ns.completion} new tokens, {ns.rounds} rounds")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--port", type=int, default=8766)
    ns = p.parse_args(argv)
    if not available():
        print(SKIP)
        return
    rows = run(ns)
    print("| figure | median | min | max |")
    print("|---|---|---|---|")
    for key, label in (("publish_s_per_100mb", "publish, s per 100 MB"), ("tokens_per_s", "generation, tokens/s")):
        values = [r[key] for r in rows]
        print(f"| {label} | {statistics.median(values):.4g} | {min(values):.4g} | {max(values):.4g} |")


if __name__ == "__main__":
    main()
