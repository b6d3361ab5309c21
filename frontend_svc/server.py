"""GenerationService servicer: thin; protobuf ends in convert.py."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from frontend_svc import convert
from frontend_svc.async_engine import AsyncEngine
from frontend_svc.engine_types import EngineInfo
from frontend_svc.input_processor import InputProcessor
from frontend_svc.output_processor import EngineUnavailable
from frontend_svc.requests import FinishReason, InvalidRequest
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc

logger = logging.getLogger(__name__)


class GenerationServicer(gen_grpc.GenerationServiceServicer):
    """The public API: Generate, Tokenize, Detokenize, GetModelInfo."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._attached: tuple[InputProcessor, EngineInfo, str] | None = None

    def attach(self, inputs: InputProcessor, info: EngineInfo, served_model_name: str) -> None:
        """Start answering: called once the engine core's facts are known."""
        self._attached = (inputs, info, served_model_name)

    async def _ready(
        self, context: grpc.aio.ServicerContext
    ) -> tuple[InputProcessor, EngineInfo, str]:
        if self._attached is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the frontend is starting and not yet connected to the engine core; retry shortly",
            )
        assert self._attached is not None
        return self._attached

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: gen_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb2.GenerateResponse]:
        arrival = time.monotonic()
        inputs, _, _ = await self._ready(context)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex[:16]}"
        try:
            call = convert.generate_input_from_proto(request, request_id, inputs.sampling_defaults)
            engine_request = inputs.process(call)
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        try:
            async for delta in self.engine.generate(engine_request, arrival):
                if delta.finish_reason == FinishReason.ERROR:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the engine failed while serving request {request_id}: "
                        f"{delta.error_message or 'unknown error'}; retry it",
                    )
                yield convert.delta_to_proto(request_id, delta)
        except EngineUnavailable as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))

    async def Tokenize(  # noqa: N802
        self, request: gen_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.TokenizeResponse:
        inputs, info, _ = await self._ready(context)
        prompt = convert.prompt_from_proto(request)
        if prompt.text is None and prompt.chat is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "set `prompt` text or `chat` to tokenize"
            )
        try:
            ids = inputs.tokenize(prompt).token_ids
        except InvalidRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        return gen_pb2.TokenizeResponse(
            token_ids=ids, tokens=tokens, max_model_len=info.max_model_len
        )

    async def Detokenize(  # noqa: N802
        self, request: gen_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.DetokenizeResponse:
        _, info, _ = await self._ready(context)
        ids = list(request.token_ids)
        bad = [i for i in ids if i >= info.vocab_size]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token id {bad[0]} is outside the vocabulary (valid ids: "
                f"0..{info.vocab_size - 1})",
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        return gen_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(  # noqa: N802
        self, request: gen_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.GetModelInfoResponse:
        inputs, info, served_model_name = await self._ready(context)
        tok = self.tokenizer
        reply = gen_pb2.GetModelInfoResponse(
            served_model_name=served_model_name,
            model_path=info.model_path,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            has_chat_template=inputs.has_chat_template,
            dtype=info.dtype,
            tensor_parallel_size=info.tensor_parallel_size,
            pipeline_parallel_size=info.pipeline_parallel_size,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            max_num_seqs=info.max_num_seqs,
        )
        if tok.eos_token_id is not None:
            reply.eos_token_id = tok.eos_token_id
        if tok.bos_token_id is not None:
            reply.bos_token_id = tok.bos_token_id
        return reply
