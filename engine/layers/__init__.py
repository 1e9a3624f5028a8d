"""The building blocks a forward pass is made of (nano-vllm's `layers/`).

attention.py           paged attention: the torch reference, and dispatch to engine.kernels
attention_metadata.py  what a pass tells attention: positions, slots, block tables, mask
packed_linear.py       linear weights prepacked in oneDNN's layout for CPU inference
quantized_linear.py    weight-only quantized linears: our CPU kernel, else torch's; on CUDA the stored blocks (Triton)
sampler.py             greedy / temperature / top-k / top-p with a seeded generator
"""
