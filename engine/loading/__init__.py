"""From a model reference to weights on the device: safetensors or GGUF, never pickle by
default, never trust_remote_code unless the user asks.

loader.py      resolve a reference (local folder, GGUF, hub id on request, the embedded
               default) and stream its weights into engine.models
checkpoint.py  a checkpoint on disk: which file holds each tensor, read one at a time
fused_experts.py  gpt-oss's fused (or MXFP4) expert tensors seen one tensor per expert
gguf_tensors.py  a GGUF's tensors as stored: their types, blocks decoded into the quantized
               kernels' forms (Q4_0/Q4_1/Q4_K: int4 groups; Q5_0/Q5_1/Q5_K/Q6_K/Q8_0: int8
               groups), the rest dequantized tensor by tensor (a stacked expert tensor: expert
               by expert)
awq_gptq.py    a safetensors AWQ/GPTQ checkpoint's packed int4 linears, as int4 groups or dequantized
stored_formats.py  the one table of how each stored format is served on each device, and why
weight_quant.py  the weight_dtype setting: which linears are served quantized, from what
synthetic.py   random-weight checkpoints of real architectures, for tests and benches
synthetic_gguf.py  the same as GGUF files in llama.cpp's layouts and mixes (Q4_K_M, Q5_K_M; MXFP4_MOE for
               gpt-oss; stacked expert tensors), k-quant and MXFP4 blocks packed here
"""
