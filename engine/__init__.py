"""pdserve engine: configs, sampling params, requests, the engine core and the offline LLM API."""
from engine.types import SamplingParams


def __getattr__(name: str):
    # Lazy so that `import engine.config` does not pull in torch-heavy modules.
    if name in ("LLM", "RequestOutput"):
        from engine import llm
        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "RequestOutput", "SamplingParams"]
