"""worker_svc: one tensor-/pipeline-parallel rank of the model (vLLM's Worker + ModelRunner).

server.py         WorkerServicer on a synchronous gRPC server, a thread per RPC: an Execute
                  stream's steps run in order on a step thread of its own; model calls are
                  serialised
request_stream.py an Execute stream's requests, received ahead of the step loop
output_stream.py  its outputs, written beside the step loop
convert.py        protobuf <-> the worker's own types (the only other `*_pb2` importer)
worker.py         Worker: describe, load_model (joins torch.distributed, picks the attention
                  backend for the block size, once), KV capacity, execute
model_runner.py   one step: state update -> inputs -> forward -> logits -> sample -> output
input_batch.py    per-request state across steps; vectorized step inputs
kv_cache.py       paged KV tensors per layer, null block (block 0), capacity arithmetic
attention/        backends: torch (reference), cpu, triton (our kernel), flash_attn (paged API);
                  selector.py picks one (a lazy table of their classes); kv_quant.py: the fp8
                  KV cache's dtypes, scales, quantize / dequantize
layers/           embedding / LM head (vocab-parallel), linears (column/row-parallel, fused qkv
                  and gate_up; their weights held by a LinearMethodBase: unquantized, fp8.py),
                  ops that pick CPU kernels or torch when built (custom_op.py: RMSNorm, rotary,
                  activations), rope and MoE configs; never imports models/
models/           interfaces.py (CausalLM, SupportsImages), registry.py (architecture ->
                  (module, class), imported on use), decoder.py (what every family shares,
                  BuildContext), one file per family (llama, gemma2/3, phi3, mixtral,
                  qwen3_moe, granite, llava + clip)
kernels/          cpu_ops.cpp (RMSNorm, rotary, SiLU-and-mul, LoRA), attention_ops.cpp (paged
                  decode, bf16/float or fp8 caches), quant_ops.cpp; built on first use
weights.py        safetensors / GGUF checkpoints, FP8 scans (which layers keep FP8), dtype choice
sampler.py        batched sampling; penalties.py, logprobs.py, prompt_logprobs.py,
                  sampling_metadata.py (per-request SamplerParams as columns, checked with
                  splitserve_contracts.sampling_rules)
distributed.py    TP groups and PP send/recv
"""
