"""The scheduler (vLLM's v1/core/sched): one token budget per step, its queues, policies, config, stats, the step it builds and the output it applies."""
