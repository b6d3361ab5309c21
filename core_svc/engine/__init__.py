"""The engine core (vLLM's EngineCore, EngineCoreProc): the step, the busy loop, its inbox, each client's requests and what is checked in them."""
