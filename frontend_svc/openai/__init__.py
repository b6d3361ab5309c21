"""The OpenAI-compatible HTTP API, served by the frontend process beside gRPC, over the same
AsyncEngine: request parsing (protocol.py, fields.py), the table-driven SamplingParams mapping
(sampling_map.py), the generation routes (serving_completion.py, serving_chat.py, generation.py),
SSE framing (sse.py), the small routes (admin.py), the app (app.py) and its uvicorn server
(server.py). docs/openai.md lists what is supported."""
