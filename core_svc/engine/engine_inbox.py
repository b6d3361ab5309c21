"""EngineInbox: everything the engine core's busy loop is told, in the order it was told.

The network handlers (adds, aborts, closed streams), the service (drain, shutdown), the
executors (a rank failed) and the rank recovery (the ranks are back, or gave up) all put
commands here, from any thread; the busy loop (core_svc/engine/engine_loop.py) takes them. Because the
inbox exists before the loop and the executors, whoever reports to the loop is built with the
inbox, never with the loop itself.

Aborts (and closed clients, drains) also go to a side list under a lock. The lock makes "drain
the queue, clear the side list" atomic, so whatever is on the side list when a step's executor
call returns arrived during that step; the loop applies it before the step's outputs are made,
and an aborted request emits nothing more. The same command, met again in the queue, is then a
no-op.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from core_svc.executor.abstract import Executor, Fault, FaultCause
from core_svc.request import Request


class CommandKind(Enum):
    ADD = 1
    ABORT = 2
    CLOSE_CLIENT = 3
    SHUTDOWN = 4
    DRAIN = 5
    """Refuse new requests from now on; running ones finish."""
    ABORT_ALL = 6
    """End every request with an error (the drain ran out of time)."""
    FAULT = 7
    """The executor failed outside a step (a rank seen dying while the engine was idle)."""
    RESUME = 8
    """The ranks are back: step on a new executor."""
    GIVE_UP = 9
    """The ranks did not come back in time: fail every request."""
    TOKENIZER = 10
    """A client's tokenizer, for its structured-outputs requests."""
    WAKE = 11
    """Nothing but a wake-up: a grammar finished compiling (or ran out of time)."""
    SUBSCRIBE_KV_EVENTS = 12
    """Send the client the prefix cache as events, then its changes (again: a resync)."""
    RESET_PREFIX_CACHE = 13
    """Forget the prefix cache unless requests hold blocks."""
    PROFILE = 14
    """Start or stop the worker ranks' profilers (between two steps)."""
    RETIRE_LORA = 15
    """A LoRA adapter was unloaded: the workers drop it once no request runs it."""


@dataclass(slots=True)
class EngineCommand:
    """One input of the loop, in the order it was put in the inbox."""

    kind: CommandKind
    client_id: int = 0
    requests: list[Request] = field(default_factory=list)
    client_handles: list[int] = field(default_factory=list)
    executor: Executor | None = None
    fault: Fault | None = None
    num_blocks: int = 0
    done: Future[int | None] | None = None
    """RESUME: resolved with the number of requests resumed (None: the engine failed first);
    RESET_PREFIX_CACHE: with the KV blocks requests held when it refused (0: reset);
    RETIRE_LORA: with the requests still running the adapter."""
    tokenizer_json: str = ""
    """TOKENIZER: the serialized tokenizer (its EOS ids in client_handles); PROFILE: the trace
    files' prefix (the action in num_blocks: 1 start, 2 stop, ProfileAction's numbers)."""
    lora_id: int = 0
    """RETIRE_LORA: the adapter."""


class EngineInbox:
    """The busy loop's inputs; every method but `take` and `take_step_aborts` (the loop's) is
    thread-safe. `commands` replaces the plain queue (tests observe the loop blocking on it)."""

    def __init__(self, commands: queue.Queue[EngineCommand] | None = None) -> None:
        self._queue: queue.Queue[EngineCommand] = commands or queue.Queue()
        self._lock = threading.Lock()
        self._step_aborts: list[EngineCommand] = []

    def add_requests(self, client_id: int, requests: list[Request]) -> None:
        self._queue.put(EngineCommand(CommandKind.ADD, client_id, requests=requests))

    def abort_requests(self, client_id: int, client_handles: Iterable[int]) -> None:
        command = EngineCommand(CommandKind.ABORT, client_id, client_handles=list(client_handles))
        self._put_abort(command)

    def close_client(self, client_id: int) -> None:
        """The client's stream closed: abort all of its requests."""
        self._put_abort(EngineCommand(CommandKind.CLOSE_CLIENT, client_id))

    def set_tokenizer(self, client_id: int, tokenizer_json: str, eos_token_ids: list[int]) -> None:
        """The client's tokenizer (before its structured-outputs requests, in stream order)."""
        command = EngineCommand(CommandKind.TOKENIZER, client_id, client_handles=eos_token_ids)
        command.tokenizer_json = tokenizer_json
        self._queue.put(command)

    def wake(self) -> None:
        """Wake the loop (any thread): a grammar compile ended."""
        self._queue.put(EngineCommand(CommandKind.WAKE))

    def subscribe_kv_events(self, client_id: int) -> None:
        """From the next iteration on, send the client the KV-cache events, starting with a
        snapshot of the cache (asked again: a fresh snapshot, for a client that fell behind)."""
        self._queue.put(EngineCommand(CommandKind.SUBSCRIBE_KV_EVENTS, client_id))

    def reset_prefix_cache(self) -> Future[int | None]:
        """Forget the prefix cache between two steps; the future gives 0 when it did, else the
        number of KV blocks requests held (it refused, as vLLM does)."""
        done: Future[int | None] = Future()
        command = EngineCommand(CommandKind.RESET_PREFIX_CACHE)
        command.done = done
        self._queue.put(command)
        return done

    def profile(self, action: int, prefix: str) -> Future[int | None]:
        """Start (1) or stop (2) the ranks' profilers between two steps; the future gives 0
        once the command went to every rank, 1 when the engine's executor cannot profile."""
        done: Future[int | None] = Future()
        command = EngineCommand(CommandKind.PROFILE, num_blocks=action, done=done)
        command.tokenizer_json = prefix
        self._queue.put(command)
        return done

    def retire_lora(self, lora_id: int) -> Future[int | None]:
        """An unloaded LoRA adapter: the future gives the requests that still run it (they
        finish with it; then the workers drop it)."""
        done: Future[int | None] = Future()
        command = EngineCommand(CommandKind.RETIRE_LORA, lora_id=lora_id, done=done)
        self._queue.put(command)
        return done

    def drain(self) -> None:
        """Refuse new requests; the running ones finish."""
        self._put_abort(EngineCommand(CommandKind.DRAIN))

    def abort_all(self) -> None:
        """End every request now, with an error saying the engine is shutting down."""
        self._put_abort(EngineCommand(CommandKind.ABORT_ALL))

    def executor_failed(self, executor: Executor, message: str, cause: FaultCause) -> None:
        """`executor` failed (any thread); ignored unless it is still the engine's."""
        fault = Fault(cause, f"executor failed: {message}")
        self._queue.put(EngineCommand(CommandKind.FAULT, executor=executor, fault=fault))

    def resume(self, executor: Executor, num_blocks: int) -> Future[int | None]:
        """Step on `executor` (the ranks are back, with `num_blocks` KV blocks); the future
        gives the number of requests resumed, or None when the engine failed meanwhile."""
        done: Future[int | None] = Future()
        command = EngineCommand(CommandKind.RESUME, executor=executor, num_blocks=num_blocks)
        command.done = done
        self._queue.put(command)
        return done

    def give_up(self, message: str) -> None:
        """Fail every request with `message` (the ranks did not come back); the engine is
        failed from now on."""
        self._queue.put(EngineCommand(CommandKind.GIVE_UP, fault=Fault("rank_died", message)))

    def shutdown(self) -> None:
        """Stop the loop after the current iteration."""
        self._queue.put(EngineCommand(CommandKind.SHUTDOWN))

    def take(self, wait: bool, timeout: float | None = None) -> list[EngineCommand]:
        """The loop: every command waiting (blocking for the first when `wait`, for at most
        `timeout` seconds when given); the side list of aborts starts over."""
        commands = []
        if wait:
            with contextlib.suppress(queue.Empty):
                commands.append(self._queue.get(timeout=timeout))
        with self._lock:
            while True:
                try:
                    commands.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._step_aborts.clear()
        return commands

    def take_step_aborts(self) -> list[EngineCommand]:
        """The loop: the aborts that arrived since `take` (during a step)."""
        with self._lock:
            aborts, self._step_aborts = self._step_aborts, []
        return aborts

    def _put_abort(self, command: EngineCommand) -> None:
        with self._lock:
            self._queue.put(command)
            self._step_aborts.append(command)
