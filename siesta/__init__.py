"""siesta: an LLM inference engine whose offloaded KV tier survives sleep."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from siesta.entrypoints.llm import LLM
    from siesta.request import CompletionOutput, RequestOutput
    from siesta.sampling import SamplingParams

_LAZY = {
    "LLM": "siesta.entrypoints.llm",
    "SamplingParams": "siesta.sampling",
    "RequestOutput": "siesta.request",
    "CompletionOutput": "siesta.request",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that importing one submodule (or a subprocess that only hashes) stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'siesta' has no attribute {name!r}")
