"""Whether the engine core has room for a request it could run: its KV cache holds the tokens
the request may reach, and the queue is within --max-num-queued-reqs / --max-num-queued-tokens
(a full queue refuses a new request with OVERLOADED: HTTP 429 and a retry hint)."""

from __future__ import annotations

from core_svc.request import Request
from core_svc.sched.scheduler_config import SchedulerConfig
from splitserve_contracts.output_types import ErrorKind


def kv_capacity_problem(
    request: Request, max_model_len: int, block_size: int, num_usable_blocks: int
) -> str | None:
    """Why the request can never fit the KV cache, or None."""
    max_num_tokens = min(request.num_prompt_tokens + request.max_tokens, max_model_len)
    if -(-max_num_tokens // block_size) > num_usable_blocks:
        return (
            f"the request may need {max_num_tokens} tokens of KV cache, more than the "
            f"{num_usable_blocks * block_size} the cache holds"
        )
    return None


def overload_reason(
    request: Request,
    config: SchedulerConfig,
    num_waiting_reqs: int,
    num_waiting_tokens: int,
    num_kv_cache_tokens: int,
) -> tuple[ErrorKind, str] | None:
    """A full queue refuses a new request. A resumed one (a frontend resubmits what an
    engine core admitted before) was admitted once: a core holds at most max_num_seqs
    running requests, with their tokens in its KV cache, besides its queue, so resumed
    requests get that much room beyond the limits - no more, whoever marks them."""
    options = config.scheduler
    max_reqs, max_tokens = options.max_num_queued_reqs, options.max_num_queued_tokens
    room = ""
    if request.is_resumed:
        max_reqs += options.max_num_seqs if max_reqs else 0
        max_tokens += num_kv_cache_tokens if max_tokens else 0
        room = " even for a resumed request"
    if max_reqs and num_waiting_reqs >= max_reqs:
        return ErrorKind.OVERLOADED, (
            f"the engine's queue is full{room} ({num_waiting_reqs} requests waiting, "
            f"--max-num-queued-reqs {options.max_num_queued_reqs}); retry later"
        )
    if max_tokens and num_waiting_tokens + request.num_tokens > max_tokens:
        return ErrorKind.OVERLOADED, (
            f"the engine's queue is full{room} ({num_waiting_tokens} prompt "
            f"tokens waiting, --max-num-queued-tokens {options.max_num_queued_tokens}); "
            "retry later"
        )
    return None
