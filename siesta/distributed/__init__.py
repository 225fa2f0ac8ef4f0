"""Tensor parallelism's machinery: the ranks' process group, their processes and the channel
that carries calls to them. It knows nothing of models; ``siesta.core`` says what ranks run."""
