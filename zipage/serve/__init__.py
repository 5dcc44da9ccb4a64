"""Online serving: `zipage serve` (an OpenAI-compatible HTTP server over the real engine) and
`zipage bench serve` (replays a trace against any OpenAI-compatible server in real time).

Modules: `engine_process` (the engine loop in a process of its own), `engine_client` (its
HTTP-side handle: requests in, tokens out), `wire` (the messages between them), `detokenize`
(incremental text and stop strings), `protocol` (request and response bodies), `metrics`
(Prometheus), `app` (the FastAPI routes), `bench` (the trace client), `cli` (both commands).
The `serve` extra installs what they need: pip install 'zipage[serve]'.
"""

# The largest request body `zipage serve` reads (--max-body-bytes): 8 MiB holds a prompt of a
# million-token context as text or ~1M token ids, and bounds what one request can make the HTTP
# process parse and hold.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Slow and numerous clients (`zipage serve --header-timeout`, `--body-timeout`,
# `--max-connections`; zipage/serve/listen.py): each open connection holds memory (the part of a
# body received), so both how long one may take and how many may be open are bounded.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0  # an 8 MiB body (the default --max-body-bytes) at 2.3 Mbit/s
DEFAULT_MAX_CONNECTIONS = 2048  # 4x the default --max-num-seqs of running requests
# The stats line's period (`zipage serve --log-stats-interval`; zipage/serve/logs.py), vLLM's.
DEFAULT_LOG_STATS_INTERVAL_S = 10.0
# What a twin replica (`zipage serve --simulate --ray`) asks Ray for: a quarter of a CPU. Its
# engine process sleeps through most of each simulated step, so four share a core (and two fit
# a 2-core machine beside the ingress); an engine replica asks for a whole CPU (or its GPUs).
TWIN_NUM_CPUS = 0.25
