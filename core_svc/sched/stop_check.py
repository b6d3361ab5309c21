"""When a request stops, checked in the engine core after each sampled token (vLLM's
check_stop). Stop strings are the frontend's: it detokenizes and aborts."""

from __future__ import annotations

from core_svc.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's final status if its last token ends it; True when it does.

    EOS (the frontend leaves it unset when the request ignores EOS) and stop_token_ids end it
    only once min_tokens outputs exist; EOS wins over a stop token id and reports no
    stop_reason. The length caps
    (max_tokens, max_model_len) apply regardless of min_tokens, after those checks.
    """
    num_output_tokens = len(request.output_token_ids)
    if num_output_tokens >= request.min_tokens and num_output_tokens > 0:
        last_token_id = request.output_token_ids[-1]
        if last_token_id == request.eos_token_id:
            request.finish(RequestStatus.FINISHED_STOPPED)
            return True
        if last_token_id in request.stop_token_ids:
            request.finish(RequestStatus.FINISHED_STOPPED)
            request.stop_reason = last_token_id
            return True
    if len(request.all_token_ids) >= max_model_len or num_output_tokens >= request.max_tokens:
        request.finish(RequestStatus.FINISHED_LENGTH_CAPPED)
        return True
    return False
