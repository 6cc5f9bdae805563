"""tinyllm: batch generation and KV-cache serving experiments with small Llama-family models.

The Python API (the commands are clients of the same):

    from tinyllm_cli import LLM, SamplingParams
    with LLM(max_num_seqs=16) as llm:          # or LLM("model.gguf", config="run.yaml", workers=2)
        for out in llm.generate(["Name a colour."], SamplingParams(max_new_tokens=16)):
            print(out.text, out.finish_reason, out.seed)
        print(llm.stats.output_tokens_per_s)

Importing the package loads nothing heavy: the names below are resolved on first use.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "RequestOutput", "Completion", "RunSummary", "Config", "load_config",
           "TinyLLMError", "UsageError"]

_WHERE = {"LLM": ".llm", "SamplingParams": ".engine.request", "RequestOutput": ".engine.request",
          "Completion": ".engine.request", "RunSummary": ".engine.stats", "Config": ".config",
          "load_config": ".config", "TinyLLMError": ".errors", "UsageError": ".errors"}


def __getattr__(name: str):
    # Lazy, so `tinyllm --help` and `import tinyllm_cli.cli` do not pay for torch.
    if name in _WHERE:
        import importlib
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tinyllm_cli' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
