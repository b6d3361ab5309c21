"""The real Shepherd Model Gateway (`smg`, the pip package's binary) in front of splitserve
engines, and the views of an engine's prefix cache the gateway tests compare:

- `core_cache`: the engine core's own cached blocks, read by subscribing to its EngineStream
  (the snapshot comes straight from the block pool);
- `GrpcKvIndex`: what a gateway rebuilds from the frontend's SubscribeKvEvents stream;
- `ZmqKvIndex`: what llm-d rebuilds from the ZMQ publisher (decoded with smg-grpc-servicer's
  own relay decoder, an independent reader of vLLM's wire format), with replay from 0.

Hashes are compared as vLLM's external block hashes (unsigned 64-bit).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import zmq
from smg_grpc_proto import vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_servicer.kv_relay import decode_batch

from core_svc.kv_cache.block_hash import hash_block_tokens
from splitserve.loopback_ports import free_ports
from splitserve_contracts.core.v1 import core_service_pb2 as core_pb2
from splitserve_contracts.core.v1 import core_service_pb2_grpc as core_grpc
from tests.e2e.stack import Stack
from tests.fixtures.core_wire import kv_events_from_proto
from tests.fixtures.kv_index import KvIndex

U64 = 1 << 64
BLOCK_SIZE = 16
KV_BYTES = str(3 * 1024 * 1024)
"""48 blocks of the tiny model (64 KiB each): a few requests evict each other's prefixes."""


@dataclass
class Engine:
    """One engine behind the gateway: a stack with KV-cache events on, published over gRPC and
    on its own ZMQ endpoints."""

    stack: Stack
    endpoint: str
    replay_endpoint: str

    def stub(self) -> vllm_engine_pb2_grpc.VllmEngineStub:
        return vllm_engine_pb2_grpc.VllmEngineStub(grpc.insecure_channel(self.stack.frontend))

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.stack.http}/v1", api_key="-", max_retries=0)


def start_engines(model: Path, count: int) -> list[Engine]:
    """`count` engines, started side by side."""
    ports = free_ports(2 * count)
    engines = []
    for i in range(count):
        config = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{ports[2 * i]}",
            "replay_endpoint": f"tcp://*:{ports[2 * i + 1]}",
        }
        stack = Stack(
            model,
            core_flags=["--kv-cache-memory-bytes", KV_BYTES, "--max-model-len", "512"],
            frontend_flags=["--kv-events-config", json.dumps(config)],
        )
        local = [f"tcp://127.0.0.1:{ports[2 * i + j]}" for j in (0, 1)]
        engines.append(Engine(stack, *local))
    with ThreadPoolExecutor(count) as pool:
        started = [pool.submit(engine.stack.start) for engine in engines]
        errors = [f.exception() for f in started]
    if any(errors):
        for engine in engines:
            engine.stack.stop()
        raise next(e for e in errors if e is not None)
    return engines


def is_idle(engine: Engine) -> bool:
    stats = engine.stack.scheduler_stats()
    return stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def smg_binary() -> str:
    found = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
    if not Path(found).exists():
        raise FileNotFoundError("the smg binary is missing: pip install 'splitserve[gateway]'")
    return found


class Gateway:
    """`smg launch` on a free loopback port, routing to `worker_addrs` over gRPC; with `prefill`
    and `decode` addresses instead, in its prefill/decode mode (--pd-disaggregation)."""

    def __init__(
        self,
        worker_addrs: list[str],
        log_path: Path,
        policy: str = "cache_aware",
        prefill: list[str] | None = None,
        decode: list[str] | None = None,
    ):
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--policy", policy, "--log-level", "info",
        ]  # fmt: skip
        if prefill or decode:
            command.append("--pd-disaggregation")
            for addr in prefill or []:
                command += ["--prefill", f"grpc://{addr}"]
            for addr in decode or []:
                command += ["--decode", f"grpc://{addr}"]
        else:
            command += ["--worker-urls", *(f"grpc://{addr}" for addr in worker_addrs)]
        self.log_path = log_path
        self.process = subprocess.Popen(  # its own group: `smg` runs the router as a child
            command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, model: str, timeout: float = 60.0) -> None:
        """Until a chat completion goes through (workers registered, tokenizer fetched)."""
        deadline = time.monotonic() + timeout
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"smg exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(request, timeout=10):
                    return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        raise TimeoutError(f"smg not ready: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        """Kill the launcher and its router child (its graceful stop waits 5 s for load
        balancers to notice; killing only the launcher would leave the router running)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def core_cache(core_addr: str, block_size: int, quiet_s: float = 0.5) -> dict[int, tuple]:
    """The engine core's cached blocks (external hash -> (parent, tokens)), from the snapshot a
    fresh EngineStream subscription gets (the engine must be idle); each block's tokens are
    checked against its SHA-256 hash, so the tokens are the cached ones."""
    stop = threading.Event()

    def requests() -> Iterator[core_pb2.EngineStreamRequest]:
        yield core_pb2.EngineStreamRequest(subscribe_kv_events=core_pb2.SubscribeKvEvents())
        stop.wait(30)  # keep the stream open while the snapshot comes

    received: queue.Queue[core_pb2.EngineStreamResponse] = queue.Queue()
    index = KvIndex()
    with grpc.insecure_channel(core_addr) as channel:
        stream = core_grpc.EngineCoreServiceStub(channel).EngineStream(requests())
        reader = threading.Thread(target=_read_into, args=(stream, received), daemon=True)
        reader.start()
        try:
            while True:
                try:
                    msg = received.get(timeout=quiet_s if index.num_cleared else 10.0)
                except queue.Empty:
                    break
                if msg.HasField("kv_events"):
                    events = kv_events_from_proto(msg.kv_events)
                    index.apply_core_events(events, block_size)
        finally:
            stop.set()
            stream.cancel()
    assert index.num_cleared == 1, "the snapshot starts with AllBlocksCleared"
    for digest, (parent, tokens) in index.blocks.items():
        assert hash_block_tokens(parent, list(tokens)) == digest, "tokens do not hash to the block"
    return {
        _external(d): (None if p is None else _external(p), t)  # type: ignore[arg-type]
        for d, (p, t) in index.blocks.items()
    }


def _read_into(stream: Iterator[core_pb2.EngineStreamResponse], out: queue.Queue[object]) -> None:
    try:
        for msg in stream:
            out.put(msg)
    except grpc.RpcError:
        return


def _external(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


class GrpcKvIndex(threading.Thread):
    """A SubscribeKvEvents consumer applying every batch to a KvIndex, as a gateway does."""

    def __init__(self, frontend_addr: str) -> None:
        super().__init__(daemon=True)
        self.index = KvIndex()
        self.num_removed = 0
        self.sequences: list[int] = []
        self._channel = grpc.insecure_channel(frontend_addr)
        stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
        self._stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        self.start()

    def run(self) -> None:
        try:
            for batch in self._stream:
                if batch.load.load_only:
                    continue
                self.sequences.append(batch.sequence_number)
                for event in batch.events:
                    self._apply(event)
        except grpc.RpcError:
            return

    def _apply(self, event: common_pb2.KvCacheEvent) -> None:
        kind = event.WhichOneof("data")
        if kind == "stored":
            blocks = event.stored.blocks
            parent = (
                event.stored.parent_block_hash % U64
                if event.stored.HasField("parent_block_hash")
                else None
            )
            size = blocks[0].block_size
            hashes = [b.block_hash % U64 for b in blocks]
            self.index.stored(hashes, parent, [t for b in blocks for t in b.token_ids], size)
        elif kind == "removed":
            self.num_removed += len(event.removed.block_hashes)
            self.index.removed(h % U64 for h in event.removed.block_hashes)
        else:
            self.index.cleared()

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()


class ZmqKvIndex(threading.Thread):
    """A ZMQ subscriber as llm-d runs one: SUB on the publisher, and the batches published
    before it joined replayed from sequence 0; batches applied once each, in order."""

    def __init__(self, endpoint: str, replay_endpoint: str, block_size: int) -> None:
        super().__init__(daemon=True)
        self.block_size = block_size
        self.index = KvIndex()
        self.next_seq = 0
        self._pending: dict[int, bytes] = {}
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay = self._context.socket(zmq.DEALER)
        self._replay.connect(replay_endpoint)
        self._stopped = threading.Event()
        self.start()

    def run(self) -> None:
        time.sleep(0.3)  # let the SUB join first: what it misses meanwhile comes by replay
        self._replay.send_multipart([b"", (0).to_bytes(8, "big")])
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while not self._stopped.is_set():
            for socket, _ in poller.poll(100):
                frames = socket.recv_multipart()
                if socket is self._replay:
                    frames = frames[1:]  # the DEALER's empty delimiter
                _, seq_bytes, payload = frames[-3:]
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq >= 0:
                    self._pending[seq] = payload
            while self.next_seq in self._pending:
                self._apply(decode_batch(self._pending.pop(self.next_seq)))
                self.next_seq += 1

    def _apply(self, batch: object) -> None:
        for event in batch.events:  # type: ignore[attr-defined]
            if event.kind == "BlockStored":
                hashes = [h % U64 for h in event.block_hashes]
                parent = None if event.parent_block_hash is None else event.parent_block_hash % U64
                self.index.stored(hashes, parent, event.token_ids, event.block_size)
            elif event.kind == "BlockRemoved":
                self.index.removed(h % U64 for h in event.block_hashes)
            elif event.kind == "AllBlocksCleared":
                self.index.cleared()
            else:
                raise AssertionError(f"an event the relay could not read: {event}")

    def close(self) -> None:
        self._stopped.set()
        self.join(5)
        self._context.destroy(linger=0)


def wait_for(condition: object, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
