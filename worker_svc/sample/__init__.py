"""Sampling on a rank (vLLM's v1/sample): the sampler, its metadata, penalties, logprobs and the grammar bitmask."""
