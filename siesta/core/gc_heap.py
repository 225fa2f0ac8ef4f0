"""The engine's start-up heap, taken out of the collector's full passes.

A full (oldest-generation) collection walks every tracked object in the process: after a
model, torch, transformers and Triton are loaded that is millions, and one such pass took
243 ms in the middle of a kept fp8 resume's first step (H200 run 56c), holding the GIL, so
the tier's copy feeder issued nothing and the first load landed 264 ms late. Objects alive
once the engine is built live as long as it does; ``gc.freeze`` moves them to a generation
the collector never walks (vLLM freezes its engine's start-up heap too). Refcounting still
frees them; only reference cycles among them wait for the next freeze, which unfreezes and
collects everything first.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect everything, what an earlier freeze kept included, then freeze what is left."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
