"""Online serving: `zipage serve` (an OpenAI-compatible HTTP server over the real engine) and
`zipage bench serve` (replays a trace against any OpenAI-compatible server in real time).

Modules: `engine` (the engine loop on its own thread, fed from asyncio), `detokenize`
(incremental text and stop strings), `protocol` (request and response bodies), `metrics`
(Prometheus), `app` (the FastAPI routes), `bench` (the trace client), `cli` (both commands).
The `serve` extra installs what they need: pip install 'zipage[serve]'.
"""
