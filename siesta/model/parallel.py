"""``TensorParallel`` lives in ``siesta.parallel``, below both the model and ``siesta.distributed``;
this name stays for the model's callers."""

from siesta.parallel import SINGLE, TensorParallel

__all__ = ["SINGLE", "TensorParallel"]
