"""Shared fixtures: the embedded model, loaded once per session, and its transformers twin."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/prompts.py and friends

# Without a GPU, Triton kernels run in its interpreter. Set before anything imports triton
# (torch._dynamo does, by itself): triton reads the flag when its own jit functions are built.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Two cores: keep torch from oversubscribing them in every test process. Under pytest-xdist
# (make test runs two workers) each worker gets its share of the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("SIESTA_TEST_THREADS", max(1, (os.cpu_count() or 1) // _WORKERS))))


def _row_independent_interpreter_dot() -> None:
    """Triton's interpreter multiplies a tile with ``np.matmul``, and OpenBLAS's AVX2 kernels sum
    a row's products in an order that depends on where the row sits in the tile (seen on an AVX2
    EPYC: a row moved within a 64-row tile changes its last bits). A GPU's MMA gives a row the same
    bits wherever it sits, which is what the batch-invariance tests check. So here each output
    element is summed over K by ``np.einsum``'s loop, the same way in any place, on any CPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):  # fp8: as Triton does
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        product = np.einsum("...mk,...kn->...mn", a_data, b_data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_independent_interpreter_dot()


@pytest.fixture(scope="session", autouse=True)
def _temp_files_in_pytest_temp(tmp_path_factory):
    """Test servers' logs, and every folder the code under test makes with ``tempfile`` (the
    fleet's and the benches' logs, IPC sockets, the ranks' folders; in this process and in the
    processes it starts), go under pytest's temp folders, which it prunes: not into /tmp for
    good, where a killed process leaves its folder. Ray keeps its own (its socket paths must stay
    under 108 characters)."""
    from e2e import servers

    servers.LOG_ROOT = tmp_path_factory.mktemp("server-logs")
    temp = str(tmp_path_factory.mktemp("tmp"))
    before = tempfile.tempdir, os.environ.get("TMPDIR"), os.environ.get("RAY_TMPDIR")
    os.environ.setdefault("RAY_TMPDIR", tempfile.gettempdir())
    tempfile.tempdir = temp
    os.environ["TMPDIR"] = temp
    yield
    tempfile.tempdir = before[0]
    for name, value in (("TMPDIR", before[1]), ("RAY_TMPDIR", before[2])):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def launch_grids(monkeypatch: pytest.MonkeyPatch):
    """``record(module, *names)``: each named Triton kernel of ``module`` still launches, and the
    returned list gets every launch's grid in order (so a test of a launch-shape knob fails if the
    knob changed nothing)."""

    def record(module, *names: str) -> list[tuple]:
        grids: list[tuple] = []

        class Recorded:
            def __init__(self, kernel) -> None:
                self.kernel = kernel

            def __getitem__(self, grid):
                grids.append(grid)
                return self.kernel[grid]

        for name in names:
            monkeypatch.setattr(module, name, Recorded(getattr(module, name)))
        return grids

    return record


@pytest.fixture(scope="session")
def embedded_source():
    from siesta.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_source):
    return embedded_source.load_tokenizer()


@pytest.fixture(scope="session")
def hf_embedded():
    """transformers' own GGUF loader over the embedded file: an oracle independent of ours."""
    from transformers import AutoModelForCausalLM

    from siesta.model.loader import default_model_path

    path = Path(default_model_path())
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once():
    """While transformers loads a GGUF: one parse of the file where it makes two (config, then
    weights; ~7 s each here, mostly the 49k-token vocabulary), and one GGUF-to-HF name table per
    architecture where it builds one per module (397). Same code, same weights bit for bit: 18 -> 9 s here."""
    import gguf

    readers: dict[str, object] = {}

    def reader(path, *args, **kwargs):
        key = os.fspath(path)
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    real_reader = gguf.GGUFReader
    with (mock.patch.object(gguf, "GGUFReader", reader),
          mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))):  # fmt: skip
        yield


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of one prompt (batch 1: no padding in the oracle).

    Stops after an EOS token, which it includes, as siesta does.
    """
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_token_ids),
            pad_token_id=eos_token_ids[0],
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_twin(source):
    """A transformers model holding ``source``'s weights (fp32): the oracle for random-init shapes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.float32)
    state = dict(source.iter_weights(torch.float32, "cpu"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    model.tie_weights()
    return model.eval()
