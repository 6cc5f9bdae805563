"""One module per engine of the comparison: tinyllm and transformers in this process; OpenVINO
GenAI and vLLM CPU in worker processes under their own venvs (``benchmarks/workers``); llama.cpp
as its own binaries. Each batched engine has ``run(prompts, output_len) -> Run`` and ``close()``.
"""
