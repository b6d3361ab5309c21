"""What runs the model for the engine core (vLLM's Executor): the interface, the gRPC executor over the worker ranks, the step timeout."""
