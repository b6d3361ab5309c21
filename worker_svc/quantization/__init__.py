"""Quantized checkpoints and online quantization: which layers hold quantized weights and where
those weights come from (the methods and kernels are in worker_svc/layers and kernels)."""
