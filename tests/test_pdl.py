"""Programmatic dependent launch (``siesta/pdl.py``): the switch, where it is honoured, the rule
every taking-part kernel keeps (wait first), and on a Hopper card the same bits with it on."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from siesta import LLM, SamplingParams, pdl
from siesta.config import EngineConfig

# The decode path's Triton kernels that take part: module -> kernel names.
TAKING_PART = {
    "siesta.model.triton_gemv": ("_gemv_kernel", "_split_k_reduce_kernel", "_add_norm_gemv_kernel"),
    "siesta.model.triton_ops": ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_kernel", "_qk_norm_rope_kernel"),
    "siesta.attention.triton_kv_write": ("_write_kv_kernel",),
    "siesta.attention.triton_kernels": ("decode_split_kernel", "reduce_splits_kernel"),
    "siesta.model.triton_router": ("_route_kernel", "_linear_route_kernel"),
    "siesta.model.triton_moe": ("_gate_up_pair_kernel", "_down_sum_kernel", "_down_pair_kernel"),
    "siesta.model.triton_align": ("_align_kernel",),
    "siesta.core.argmax": ("_chunk_max_kernel", "_pick_chunk_kernel"),
}
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= pdl.MIN_CAPABILITY


@pytest.fixture
def switch(monkeypatch: pytest.MonkeyPatch):
    """The process-wide switch, restored after the test."""
    monkeypatch.setattr(pdl, "_enabled", False)
    return pdl


def test_on_by_default_and_never_on_the_cpu(switch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIESTA_PDL", raising=False)
    assert EngineConfig().programmatic_dependent_launch is True
    cpu = torch.device("cpu")
    switch.set_enabled(True)
    assert switch.enabled() and not switch.supported(cpu)
    assert switch.launch(cpu) == {"USE_PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("value", ["0", "false", "No"])
def test_the_environment_turns_it_off_and_the_engine_sets_the_switch(switch, value: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    switch.set_enabled(True)
    monkeypatch.setenv("SIESTA_PDL", value)
    assert EngineConfig().programmatic_dependent_launch is False
    LLM(model="random:tiny-llama", dtype="float32", kv_cache_bytes=16 << 20)
    assert not switch.enabled()


def _taking_part_kernels():
    for module_name, names in TAKING_PART.items():
        module = importlib.import_module(module_name)
        for name in names:
            yield f"{module_name}.{name}", getattr(module, name)


def test_every_kernel_that_takes_part_waits_before_anything_else() -> None:
    """The correctness rule: the wait is each kernel's first statement (after its docstring), so no
    program reads or writes memory before the grid before it has finished; and no kernel lets its
    dependents launch early (measured slower, run 58b)."""
    for label, kernel in _taking_part_kernels():
        assert "USE_PDL" in kernel.arg_names, label
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        assert ast.unparse(body[0]) == "pdl.wait_for_previous_grid(USE_PDL)", label
        assert "launch_dependents" not in ast.unparse(tree), label


def test_no_other_kernel_claims_to_take_part() -> None:
    """A kernel given a USE_PDL parameter anywhere in siesta is listed above, so the rule's test
    covers it (read from the sources: no module needs importing to be found)."""
    listed = {label for label, _ in _taking_part_kernels()}
    root = Path(pdl.__file__).parent
    for path in root.rglob("*.py"):
        module_name = ".".join(("siesta", *path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "USE_PDL" for a in node.args.args):
                if node.name != "wait_for_previous_grid":
                    assert f"{module_name}.{node.name}" in listed, f"{module_name}.{node.name}"


@pytest.mark.skipif(not ON_HOPPER, reason="programmatic dependent launch needs a CUDA card of capability 9.0+")
@pytest.mark.parametrize("model", ["random:tiny-qwen3-moe", "random:tiny-llama"])
def test_the_same_tokens_and_logprobs_with_it_on(switch, model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the decode graphs (batch 1 and 3) and eager steps: PDL changes only when programs
    start, so a missing wait would show as other bits."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("SIESTA_PDL", flag)
        llm = LLM(model=model, dtype="bfloat16", kv_cache_bytes=256 << 20)
        outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs])
        assert switch.active(torch.device("cuda")) == (flag == "1")
        del llm
    assert runs[0] == runs[1]
