"""The generation-server engine: a separate process with its own model copy (TRL's vLLM server-mode shape).

Requests and completions travel over ``torch.multiprocessing`` queues, a submit's completions in one
message (its requests of one prompt length are generated as one batch: :mod:`trainfold.rollout.sampling`);
weights travel in buckets over a private 2-rank ``torch.distributed`` group (gloo on CPU, NCCL on CUDA;
:mod:`trainfold.rollout.transport`), received by a thread of the server while its main thread generates.
The server handles publishes and submits in the order the trainer made them, so a request's version (and so
its tokens) never depends on timing. The server dying is noticed by ``submit``/``poll``/``publish``, which
raise :class:`EngineDied`.
"""

from __future__ import annotations

import copy
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from trainfold.rollout.engine import (
    Completion,
    EngineDied,
    RolloutRequest,
    Weights,
    check_requests,
    gather_weights,
    restored,
)
from trainfold.rollout.local import check_weights
from trainfold.rollout.sampling import BatchFailed, complete_all
from trainfold.rollout.transport import TensorMeta, WeightChannel, plan_buckets

__all__ = ["ProcessEngine"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _completion_message(c: Completion) -> dict[str, Any]:
    return {**c.to_dict(), "logps": c.logps.tolist()}  # float32 -> float -> float32 is exact


class _Buffers:
    """The server's weights in use and the spare tensors a publish replaced (received into next time)."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        self.weights = weights
        self.staged: dict[int, dict[str, Tensor]] = {}
        self.spare: dict[str, Tensor] = {}
        self.lock = threading.Lock()

    def take_spare(self) -> dict[str, Tensor]:
        with self.lock:
            spare, self.spare = self.spare, {}
        return spare

    def apply(self, version: int) -> None:
        with self.lock:
            new = self.staged.pop(version)
            self.spare.update((k, self.weights[k]) for k in new if k in self.weights)
            self.weights = {**self.weights, **new}


def _receive_weights(channel: WeightChannel, inbox: Any, buffers: _Buffers, ack: Any) -> None:
    """Server thread: receive each announced publish (into spare tensors where it can), stage it, ack."""
    while True:
        message = inbox.get()
        if message is None:
            return
        version, metas, buckets = message
        received = channel.receive(metas, buckets, into=buffers.take_spare())
        with buffers.lock:
            buffers.staged[version] = received
        ack.put(version)


def _watch_parent(parent: int, every_s: float = 0.5) -> None:
    """Server thread: end the process once its trainer is gone (a trainer killed with -9 closes nothing, and a
    daemon process outlives a parent that never ran its exit handlers): the server is then re-parented."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def _serve(model: nn.Module, config: dict[str, Any], commands: Any, results: Any, inbox: Any, ack: Any) -> None:
    """The server process: one model copy; publishes staged by the receiver thread, applied in command order.

    The model's tensors arrive in shared memory (torch.multiprocessing), so the weights start as clones. It ends
    with its trainer, however that ends (``_watch_parent``).
    """
    threading.Thread(target=_watch_parent, args=(config["parent"],), daemon=True).start()
    torch.set_num_threads(config["threads"])
    channel = WeightChannel("127.0.0.1", config["port"], 1, config["backend"], config["timeout_s"])
    device = channel.device
    buffers = _Buffers({k: v.detach().to(device).clone() for k, v in model.to(device).state_dict().items()})
    receiver = threading.Thread(target=_receive_weights, args=(channel, inbox, buffers, ack), daemon=True)
    receiver.start()
    version = -1
    for kind, payload in iter(commands.get, ("close", None)):
        if kind == "publish":
            buffers.apply(payload)
            version = payload
            continue
        requests = [RolloutRequest.from_dict(d) for d in payload]  # a submit: one batch per prompt length
        try:
            done = complete_all(model, buffers.weights, requests, version, eos_token_id=config["eos"])
        except BatchFailed as e:  # reported to the trainer, named; the submission's other requests with it
            results.put(("error", {"request_ids": [r.request_id for r in requests], "error": str(e)}))
            continue
        results.put(("done", [_completion_message(c) for c in done]))
    inbox.put(None)
    receiver.join()
    channel.close()


class ProcessEngine:
    """A :class:`~trainfold.rollout.engine.RolloutEngine` whose generation runs in a server process.

    ``model`` is pickled into the server (its weights do not matter: ``publish`` sends them);
    ``bucket_mb`` sizes the transfer's buckets; ``backend`` is ``"gloo"`` (CPU) or ``"nccl"`` (the
    server generates on CUDA). ``timeout_s`` bounds the wait of a publish or a ``poll`` for the server.
    ``pad_token_id`` pads nothing (a batch holds prompts of one length), kept for the engines' signature.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
        bucket_mb: float = 64.0,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r} is not one of ['gloo', 'nccl']")
        self._shapes = {k: v.detach().to("meta") for k, v in model.state_dict().items()}
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._commands, self._results, self._inbox, self._ack = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
        port = _free_port()
        config = {"port": port, "backend": backend, "timeout_s": timeout_s, "eos": eos_token_id}
        config["threads"], config["parent"] = torch.get_num_threads(), os.getpid()
        # a copy: torch.multiprocessing moves the tensors it sends into shared memory, shared with the server
        args = (copy.deepcopy(model), config, self._commands, self._results, self._inbox, self._ack)
        self.process = ctx.Process(target=_serve, args=args, daemon=True, name="trainfold-rollout-server")
        self.process.start()
        self._channel = WeightChannel("127.0.0.1", port, 0, backend, timeout_s)
        self._version: int | None = None
        self._pending: dict[str, tuple[RolloutRequest, int]] = {}  # submitted, not back yet
        self._done: list[Completion] = []
        self._closed = False

    @property
    def version(self) -> int | None:
        return self._version

    def _check_alive(self, doing: str) -> None:
        if self._closed:
            raise RuntimeError(f"ProcessEngine.{doing} after close()")
        if not self.process.is_alive():
            lost = sorted(self._pending)
            raise EngineDied(
                f"the rollout server process (pid {self.process.pid}) died with exit code {self.process.exitcode} "
                f"during {doing}; {len(lost)} open requests are lost ({lost[:8]}{'...' if len(lost) > 8 else ''}): "
                "start a new ProcessEngine, publish the weights and submit them again, in the submits they came in "
                "(generation is deterministic; EngineDied.lost has them, in order, with their versions)",
                list(self._pending.values()),
            )

    def publish(self, version: int, weights: Weights) -> None:
        self._check_alive("publish")
        pairs = gather_weights(weights, copy=False)  # every collective runs here; the bytes are sent before return
        check_weights(self._shapes, pairs)
        metas: list[TensorMeta] = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in pairs]
        buckets = plan_buckets(metas, self.bucket_bytes)
        self._inbox.put((int(version), metas, buckets))
        self._channel.send([t for _, t in pairs], buckets)
        self._wait(self._ack, "publish")
        self._commands.put(("publish", int(version)))  # applied after the requests submitted before it
        self._version = int(version)

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        self._check_alive("submit")
        check_requests(requests, [*self._pending, *(c.request_id for c in self._done)], self._version)
        assert self._version is not None
        for r in requests:
            self._pending[r.request_id] = (r, self._version)
        self._commands.put(("submit", [r.to_dict() for r in requests]))

    def _wait(self, q: Any, doing: str, timeout_s: float | None = None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                self._check_alive(doing)
                if time.monotonic() > deadline:
                    message = f"the rollout server gave nothing for {timeout_s}s during {doing}"
                    raise TimeoutError(message) from None

    def _take(self, message: tuple[str, Any]) -> None:
        kind, body = message
        if kind == "error":
            for request_id in body["request_ids"]:
                self._pending.pop(request_id, None)
            n = len(body["request_ids"])
            raise RuntimeError(f"{body['error']} (in the server process; the {n} requests of that submit are dropped)")
        for d in body:
            c = Completion.from_dict(d)
            self._pending.pop(c.request_id)
            self._done.append(c)

    def poll(self, min_items: int = 0, timeout_s: float | None = None) -> list[Completion]:
        self._check_alive("poll")
        if min_items > len(self._pending) + len(self._done):
            raise ValueError(f"poll(min_items={min_items}) but only {len(self._pending) + len(self._done)} are open")
        while True:
            try:
                self._take(self._results.get_nowait())
            except queue.Empty:
                break
        while len(self._done) < min_items:
            self._take(self._wait(self._results, "poll", timeout_s))
        out, self._done = self._done, []
        return out

    def state_dict(self) -> dict[str, Any]:
        """Wait for the requests in flight (their tokens depend on nothing else) and return them unpolled."""
        while self._pending:
            self._take(self._wait(self._results, "state_dict"))
        return {"completions": [c.to_dict() for c in self._done], "pending": []}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._done, pending = restored(state, self._version)
        if pending:
            self.submit(pending)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            self._commands.put(("close", None))
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._channel.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
