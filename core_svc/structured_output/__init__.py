"""Structured outputs in the engine core (vLLM's v1/structured_output): grammars, a request's matcher, each step's bitmask."""
