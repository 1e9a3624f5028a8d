"""Headless measurements: `python -m engine.bench SCENARIO --json` (cli.py). Inference never
imports this package.

cli.py        the command line and the scenario registry
model_flags.py which scenario takes --model / --synthetic, and the model each runs on
scenarios.py  parity, prefix, kv, memory, decode, speculative
kernels.py    decode-attention kernel speed against copy bandwidth; on the CPU, the model's
              quantized linears by row count (linear_rows.py)
load.py       what a streaming load costs in memory and time
peer.py       ours next to llama.cpp's server on the same GGUF
gpu.py        gpu-check: everything that needs a GPU, in one short run
quality.py    quality: what a weight format costs; --against llama.cpp on the same GGUF
real_files.py real GGUF files made by llama.cpp (the tests' and quality's)
"""
