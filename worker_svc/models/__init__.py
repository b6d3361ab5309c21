"""Our own decoder models (no transformers modelling code) and the architecture registry."""
