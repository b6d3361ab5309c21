"""worker_svc: one tensor-/pipeline-parallel rank of the model (vLLM's Worker + ModelRunner).

server.py         WorkerServicer on a synchronous gRPC server, a thread per RPC: an Execute
                  stream's steps run in order on a step thread of its own; model calls are
                  serialised
stream/           the Execute stream around the step loop: request_stream.py (its requests,
                  received ahead), output_stream.py (its outputs, written beside),
                  stall_watch.py, step_tracing.py (per-request spans), profiler.py
convert.py        protobuf <-> the worker's own types (the only other `*_pb2` importer)
worker.py         Worker: describe, load_model (joins torch.distributed, picks the attention
                  backend for the block size, once), KV capacity, execute
model_loader/     model_build.py (a rank's model shard built: model class, shape checks, build
                  context, linear methods (FP8, quantized, LoRA), pooler config), model_load.py
                  (what LoadModel and Describe carry), weights.py (safetensors / GGUF
                  checkpoints, FP8 scans, dtype choice), pooling_config.py (how a checkpoint
                  pools)
runner/           model_runner.py (one step: state update -> inputs -> forward -> logits ->
                  sample -> output; runner_inputs.py, runner_output.py), input_batch.py
                  (per-request state across steps; its rows batch_rows.py, vectorized step
                  inputs step_inputs.py), kv_cache.py (paged KV tensors per layer, null block 0, capacity
                  arithmetic; cpu_kv_budget.py), spec_decode.py (n-gram drafts proposed and
                  verified in the step's own forward), encoder_runner.py (images: the vision
                  encoder for a step's items; encoder_cache.py keeps outputs), pooler.py
                  (embeddings), prompt_logprobs.py, warm_up.py
attention/        backends: torch (reference), cpu, triton (our kernel), flash_attn (paged API);
                  selector.py picks one (a lazy table of their classes); kv_quant.py: the fp8
                  KV cache's dtypes, scales, quantize / dequantize
layers/           embedding / LM head (vocab-parallel), linears (column/row-parallel, fused qkv
                  and gate_up; their weights held by a LinearMethodBase: unquantized, fp8.py,
                  quantized.py; LoRA slots: lora.py),
                  ops that pick CPU kernels or torch when built (custom_op.py: RMSNorm, rotary,
                  activations), rope and MoE configs; never imports models/
models/           interfaces.py (CausalLM, SupportsImages), registry.py (architecture ->
                  (module, class), imported on use), decoder.py (what every family shares,
                  BuildContext), one file per family (llama, gemma2/3, phi3, mixtral,
                  qwen3_moe, granite, bert, llava + clip)
kernels/          cpu_ops.cpp (RMSNorm, rotary, SiLU-and-mul, LoRA), attention_ops.cpp (paged
                  decode, bf16/float or fp8 caches), quant_ops.cpp (W8A16 / W4A16 linears),
                  w8a8_ops.cpp (W8A8 linears, per-token int8 activations), sampling_ops.cpp
                  (the grammar bitmask); the headers they share (cpu_common.h, quant_*.h,
                  attention_decode.h); cpu_kernels.py builds them on first use
quantization/     quantized checkpoints (GGUF, GPTQ, AWQ, compressed-tensors) and online
                  quantization: which layers hold quantized weights, and where from
lora/             LoRA adapters read from PEFT folders into the model's slots (layers/lora.py)
sample/           sampler.py (batched sampling), penalties.py, logprobs.py,
                  sampling_metadata.py (per-request SamplerParams as columns, checked with
                  splitserve_contracts.sampling_rules), grammar_bitmask.py (the engine core's
                  grammar bitmask applied to the logits: structured outputs)
distributed.py    TP groups and PP send/recv
"""
