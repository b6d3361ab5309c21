"""Quantized checkpoints and online quantization: which layers hold quantized weights and where
those weights come from (the methods and kernels are in worker_svc/layers and kernels). One file
per format, each with its `QuantizationConfig` (config.py), found by name through the registry's
rows in splitserve_runtime/quantization_names.py; plan.py checks `--quantization` against the
checkpoint and plans the layers."""
