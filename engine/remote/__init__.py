"""The remote backend: an existing OpenAI-compatible server (vLLM, SGLang, llama.cpp's
llama-server) behind the same interface as the local engine (engine.backend). The only
part of engine/ that speaks HTTP.

backend.py              RemoteBackend: connect, generate, cancel, settings
request.py              one streamed reply as StepEvents
chunk_stream.py         one streamed /v1/chat/completions call on a background thread
concurrent_streams.py   many requests at once (bench serve --backend) and the server's load
server_kinds.py         what differs between server kinds, one row each
server_metrics.py       where each number comes from on a server's /metrics
llama_server.py         a llama-server process on 127.0.0.1 (tests, bench peer)
llama_server_binary.py  where scripts/build_llama_server.sh put the binaries
llama_tools.py          llama-quantize, llama-perplexity, and llama-server's token endpoints
"""
