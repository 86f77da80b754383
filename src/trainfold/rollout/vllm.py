"""The vLLM engine: a ``vllm serve`` server, its OpenAI-compatible ``/v1/completions`` and vLLM's native
weight-transfer API (TRL's server mode). vLLM is imported here only, and only when an engine is built.

The server must run in dev mode with a weight-transfer backend::

    VLLM_SERVER_DEV_MODE=1 VLLM_BATCH_INVARIANT=1 vllm serve MODEL --load-format dummy \\
        --weight-transfer-config '{"backend": "nccl"}' --skip-tokenizer-init --logprobs-mode processed_logprobs

A publish is vLLM's four phases, driven from here: ``/pause?mode=keep`` → ``/start_weight_update`` →
``/update_weights`` (its NCCL receive runs while this process broadcasts the packed weights) →
``/finish_weight_update`` (with the version) → ``/resume``. The trainer joins the NCCL group as rank 0
(``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights``, the API TRL pins, vLLM 0.22-0.27;
newer vLLM moved it to ``WeightTransferTrainerFactory``, which this engine refuses by name).

Versions: with ``pause_mode="wait"`` every request finishes on the version it was submitted under
(exact spans). With ``"keep"`` (TRL's; no request waits) a request in flight across a publish continues
on the new weights, and vLLM does not report at which token (vllm#54443): its span then records the
version it started with, the oldest of its tokens — the staleness bound reads that version, so it stays
a bound — and its log-probs are vLLM's per token, so the importance-sampling ratio stays exact.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from trainfold.rollout.engine import Completion, RolloutRequest, Weights, check_requests, gather_weights

__all__ = ["PAUSE_MODES", "VLLMEngine"]

PAUSE_MODES = ("keep", "wait")


def _vllm_nccl() -> tuple[Any, Any]:
    try:
        from vllm.distributed.weight_transfer.nccl_engine import (  # type: ignore[import-not-found]
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )
    except ImportError as e:
        raise ImportError(f"VLLMEngine needs vLLM's NCCL weight transfer (vllm>=0.22,<0.28, as TRL pins): {e}") from e
    if not hasattr(NCCLWeightTransferEngine, "trainer_send_weights"):
        raise ImportError("this vLLM has no NCCLWeightTransferEngine.trainer_send_weights (vLLM >= 0.28): pin <0.28")
    return NCCLWeightTransferEngine, NCCLTrainerSendWeightsArgs


class VLLMEngine:
    """A :class:`~trainfold.rollout.engine.RolloutEngine` on a running ``vllm serve`` at ``base_url``.

    ``model_name`` is the served model's name; ``eos_token_id`` is passed as the stop token;
    ``max_workers`` requests are in flight at once.
    """

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        eos_token_id: int | None = None,
        pause_mode: str = "keep",
        max_workers: int = 64,
        timeout_s: float = 600.0,
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r} is not one of {list(PAUSE_MODES)}")
        import requests  # the HTTP client vLLM and TRL use

        self._http = requests.Session()
        self.base_url, self.model_name = base_url.rstrip("/"), model_name
        self.eos_token_id, self.pause_mode, self.timeout_s = eos_token_id, pause_mode, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="trainfold-vllm")
        self._lock = threading.Lock()
        self._engine, self._args_class = _vllm_nccl()
        self._group = self._init_transfer()
        self._version: int | None = None
        self._open: dict[str, tuple[RolloutRequest, int, Future]] = {}
        self._done: list[Completion] = []

    def _post(self, path: str, **kw: Any) -> Any:
        response = self._http.post(f"{self.base_url}{path}", timeout=self.timeout_s, **kw)
        response.raise_for_status()
        return response.json() if response.content else None

    def _init_transfer(self) -> Any:
        from vllm.utils.network_utils import get_ip, get_open_port  # type: ignore[import-not-found]

        world = int(self._http.get(f"{self.base_url}/get_world_size", timeout=60).json()["world_size"]) + 1
        info = {"master_address": get_ip(), "master_port": get_open_port(), "world_size": world}
        init_info = {**info, "rank_offset": 1}
        server = self._pool.submit(self._post, "/init_weight_transfer_engine", json={"init_info": init_info})
        group = self._engine.trainer_init(info)
        server.result()
        return group

    @property
    def version(self) -> int | None:
        return self._version

    def publish(self, version: int, weights: Weights) -> None:
        pairs = gather_weights(weights)  # every collective runs here, before the transfer
        update_info = {
            "names": [n for n, _ in pairs],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs],
            "packed": True,
        }
        with self._lock:
            self._post("/pause", params={"mode": self.pause_mode})
            try:
                self._post("/start_weight_update", json={"is_checkpoint_format": True})
                receive = self._pool.submit(self._post, "/update_weights", json={"update_info": update_info})
                args = self._args_class(group=self._group, packed=True)
                self._engine.trainer_send_weights(iterator=iter([(n, t.cuda()) for n, t in pairs]), trainer_args=args)
                receive.result()
                self._post("/finish_weight_update", json={"version": str(int(version))})
                self._version = int(version)
            finally:
                self._post("/resume")

    def _generate(self, request: RolloutRequest) -> dict[str, Any]:
        spec = request.spec
        body = {
            "model": self.model_name,
            "prompt": list(request.prompt_ids),
            "max_tokens": spec.max_new_tokens,
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": spec.top_k or -1,
            "seed": spec.seed,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": [] if self.eos_token_id is None else [self.eos_token_id],
            "include_stop_str_in_output": True,
        }
        return self._post("/v1/completions", json=body)["choices"][0]

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        with self._lock:
            check_requests(requests, [*self._open, *(c.request_id for c in self._done)], self._version)
            assert self._version is not None
            for r in requests:
                self._open[r.request_id] = (r, self._version, self._pool.submit(self._generate, r))

    def _completion(self, request: RolloutRequest, version: int, choice: Mapping[str, Any]) -> Completion:
        ids = tuple(int(i) for i in choice["token_ids"])
        logps = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(request, ids, logps, ((version, 0),), reason)

    def _collect(self, min_items: int, timeout_s: float | None) -> None:
        """Move finished requests (and the first ``min_items``, waiting for them) to the polled list, in order."""
        for rid, (r, v, fut) in list(self._open.items()):
            if len(self._done) >= min_items and not fut.done():
                break
            self._done.append(self._completion(r, v, fut.result(timeout=timeout_s or self.timeout_s)))
            del self._open[rid]

    def poll(self, min_items: int = 0, timeout_s: float | None = None) -> list[Completion]:
        if min_items > len(self._open) + len(self._done):
            raise ValueError(f"poll(min_items={min_items}) but only {len(self._open) + len(self._done)} are open")
        self._collect(min_items, timeout_s)
        out, self._done = self._done, []
        return out

    def state_dict(self) -> dict[str, Any]:
        """Wait for the requests in flight, as ``ProcessEngine.state_dict`` does, and return them unpolled."""
        self._collect(len(self._open) + len(self._done), None)
        return {"completions": [c.to_dict() for c in self._done], "pending": []}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._done = [Completion.from_dict(d) for d in state["completions"]]
        pending = [(RolloutRequest.from_dict(p["request"]), int(p["version"])) for p in state.get("pending", [])]
        wrong = sorted({v for _, v in pending if v != self._version})
        if wrong:
            raise ValueError(f"pending requests need weight versions {wrong}; this engine is on {self._version}")
        if pending:
            self.submit([r for r, _ in pending])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
