"""Running a model: forward passes over its own paged cache.

model_runner.py   a model with its KV pool and block manager (the target has one, a draft another)
compiled_step.py  the decode and verify step under torch.compile (CUDA graphs on CUDA)
eagle_step.py     the EAGLE head's draft step: compiled where the target's step is, else eager
cpu_dtype.py      dtype="auto" on the CPU: fp32 or bf16, whichever runs the model's decode step faster here (skipping one it cannot run)
cpu_paths.py      which path serves each part of a step here, and why (each CPU path is tried first)
kernel_check.py   whether each of our native CPU kernels runs where it must (cpu_paths --require, CI's first check)
detokenizer.py    incremental detokenization: the text each new token adds
"""
