"""The public gRPC servicers, GenerationService and AdminService: thin; protobuf ends in
convert.py."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from frontend_svc import convert, grpc_errors
from frontend_svc.engine.async_engine import AsyncEngine
from frontend_svc.engine.engine_types import EngineInfo, LoraAdapterInfo
from frontend_svc.errors import FrontendError, InvalidRequest, engine_error
from frontend_svc.inputs.input_processor import InputProcessor
from frontend_svc.openai.chat_output import AnswerReader, ChatFeatures, prepare_chat_call
from frontend_svc.openai.tools import grpc_tools
from frontend_svc.requests import DEFAULT_MAX_FAN_OUT, derived_request_id
from frontend_svc.serving import pooling
from frontend_svc.serving.served_models import ServedModels, resolve_model
from frontend_svc.tracing import set_caller_trace
from splitserve_contracts.frontend.v1 import admin_service_pb2 as admin_pb2
from splitserve_contracts.frontend.v1 import admin_service_pb2_grpc as admin_grpc
from splitserve_contracts.frontend.v1 import generation_service_pb2 as gen_pb2
from splitserve_contracts.frontend.v1 import generation_service_pb2_grpc as gen_grpc
from splitserve_contracts.output_types import FinishReason

logger = logging.getLogger(__name__)


class GenerationServicer(gen_grpc.GenerationServiceServicer):
    """The public API: Generate, Tokenize, Detokenize, GetModelInfo."""

    def __init__(
        self,
        engine: AsyncEngine,
        inputs: InputProcessor,
        info: EngineInfo,
        served_model_name: str,
        chat: ChatFeatures | None = None,
        model_aliases: tuple[str, ...] = (),
        max_fan_out: int = DEFAULT_MAX_FAN_OUT,
        models: ServedModels | None = None,
    ) -> None:
        self.engine = engine
        self.inputs = inputs
        self.tokenizer = inputs.tokenizer
        self.info = info
        self.served_model_name = served_model_name
        self.models = models
        """The served model and the engine's LoRA adapters (None: the served model only)."""
        self.chat = chat or ChatFeatures()
        """Tool calling and reasoning, as on the HTTP API."""
        self.model_aliases = model_aliases
        self.max_fan_out = max_fan_out
        """--max-fan-out: most inputs one Embed call may carry."""

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: gen_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb2.GenerateResponse]:
        arrival = time.monotonic()
        inputs = self.inputs
        request_id = request.request_id or f"gen-{uuid.uuid4().hex[:16]}"
        set_caller_trace(dict(context.invocation_metadata() or ()))
        try:
            lora_name = await resolve_model(
                self.models, request.model, self.served_model_name, self.model_aliases
            )
            pooling.check_generative(self.info, "Generate RPC")
            call = convert.generate_input_from_proto(request, request_id, inputs.sampling_defaults)
            call = dataclasses.replace(call, lora_name=lora_name)
            tools = grpc_tools(convert.tools_body_from_proto(request), self.chat.can_choose_tools)
            call, rules = prepare_chat_call(call, tools, self.chat)
            engine_request = await inputs.run(inputs.process, call)
            answers = AnswerReader(rules, engine_request.prompt_ends_reasoning)
            async for delta in self.engine.generate(engine_request, arrival):
                if delta.finish_reason == FinishReason.ERROR:
                    raise engine_error(request_id, delta.error_kind, delta.error_message)
                parsed, calls = answers.read(delta)
                listed = [(c.id, c.name, c.arguments) for c in calls]
                yield convert.delta_to_proto(request_id, delta, parsed, listed)
        except FrontendError as err:
            await grpc_errors.abort(context, err)

    async def Embed(  # noqa: N802
        self, request: gen_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.EmbedResponse:
        request_id = request.request_id or f"embd-{uuid.uuid4().hex[:16]}"
        inputs = self.inputs
        try:
            await self._check_base_model(request.model)
            config = pooling.pooler_config(self.info, "Embed RPC")
            dimensions = request.dimensions if request.HasField("dimensions") else None
            pooling.check_dimensions(config, dimensions, "dimensions")
            prompts = convert.embed_inputs_from_proto(request, self.max_fan_out)
            requests = [
                await inputs.run(
                    pooling.embed_request,
                    inputs,
                    derived_request_id(request_id, f"-{i}"),
                    prompt,
                    f"inputs[{i}]",
                    request.priority,
                )
                for i, prompt in enumerate(prompts)
            ]
            embedded = await pooling.embed_all(self.engine, requests, config, dimensions)
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        return convert.embed_response_to_proto(request_id, embedded)

    async def _check_base_model(self, requested: str) -> None:
        """Pooling requests run on the base model: a LoRA adapter's name is refused."""
        lora_name = await resolve_model(
            self.models, requested, self.served_model_name, self.model_aliases
        )
        if lora_name:
            raise InvalidRequest(
                f"LoRA adapter {lora_name!r} cannot serve pooling requests; name the base "
                f"model {self.served_model_name!r}",
                "model",
            )

    async def Tokenize(  # noqa: N802
        self, request: gen_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.TokenizeResponse:
        inputs = self.inputs
        prompt = convert.prompt_from_proto(request)
        try:
            if prompt.text is None and prompt.chat is None:
                raise InvalidRequest("set `prompt` text or `chat` to tokenize", "prompt")
            ids = (await inputs.run(inputs.tokenize, prompt)).token_ids
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        tokens = await inputs.run(self.tokenizer.convert_ids_to_tokens, ids)
        return gen_pb2.TokenizeResponse(
            token_ids=ids, tokens=tokens, max_model_len=self.info.max_model_len
        )

    async def Detokenize(  # noqa: N802
        self, request: gen_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.DetokenizeResponse:
        ids = list(request.token_ids)
        try:
            self.inputs.check_token_ids(ids, "token_ids")
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self.inputs.run(self.tokenizer.decode, ids, skip)
        return gen_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(  # noqa: N802
        self, request: gen_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.GetModelInfoResponse:
        inputs, info, served_model_name = self.inputs, self.info, self.served_model_name
        tok, options = self.tokenizer, self.info.options
        reply = gen_pb2.GetModelInfoResponse(
            served_model_name=served_model_name,
            model_path="",  # never disclosed: the server's file layout is not the client's
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            has_chat_template=inputs.has_chat_template,
            dtype=info.dtype,
            tensor_parallel_size=options.parallel.tensor_parallel_size,
            pipeline_parallel_size=options.parallel.pipeline_parallel_size,
            block_size=options.cache.block_size,
            num_kv_blocks=info.num_kv_blocks,
            max_num_seqs=options.scheduler.max_num_seqs,
            embedding_size=info.pooler_config.hidden_size if info.pooler_config else 0,
        )
        if inputs.multimodal is not None:
            reply.supports_vision = True
            reply.max_images_per_prompt = inputs.multimodal.limits.max_images_per_prompt
        if tok.eos_token_id is not None:
            reply.eos_token_id = tok.eos_token_id
        if tok.bos_token_id is not None:
            reply.bos_token_id = tok.bos_token_id
        return reply


class AdminServicer(admin_grpc.AdminServiceServicer):
    """The public admin API: the served models, LoRA adapters loaded and unloaded at runtime
    (the same rules and messages as /v1/models, /v1/load_lora_adapter and
    /v1/unload_lora_adapter)."""

    def __init__(self, models: ServedModels) -> None:
        self.models = models

    def _card(self, adapter: LoraAdapterInfo) -> admin_pb2.ModelCard:
        return admin_pb2.ModelCard(
            id=adapter.name,
            parent=adapter.base_model_name or self.models.served_model_name,
            root=adapter.path,
            max_model_len=self.models.info.max_model_len,
            lora_rank=adapter.max_rank,
        )

    async def ListModels(  # noqa: N802
        self, request: admin_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListModelsResponse:
        models = self.models
        await models.refresh()
        served = admin_pb2.ModelCard(
            id=models.served_model_name, max_model_len=models.info.max_model_len
        )
        cards = [self._card(a) for a in models.adapters.values()]
        return admin_pb2.ListModelsResponse(models=[served, *cards])

    async def LoadLoraAdapter(  # noqa: N802
        self, request: admin_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LoadLoraAdapterResponse:
        try:
            adapter = await self.models.load(
                request.lora_name, request.lora_path, request.load_inplace
            )
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        return admin_pb2.LoadLoraAdapterResponse(model=self._card(adapter))

    async def UnloadLoraAdapter(  # noqa: N802
        self, request: admin_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UnloadLoraAdapterResponse:
        try:
            num_requests = await self.models.unload(request.lora_name)
        except FrontendError as err:
            await grpc_errors.abort(context, err)
        return admin_pb2.UnloadLoraAdapterResponse(num_requests=num_requests)
