"""The frontend's engine (vLLM's v1/engine client side): AsyncEngine, the core client and its contract, the output processor and detokenizer."""
