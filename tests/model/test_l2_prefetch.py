"""L2 prefetches of decode weights (``siesta/model/l2_prefetch.py``): the kernel's walk over a
tensor's lines, when a step prefetches, which weight each window takes and in what order, and on
a card the same bits with the prefetches on."""

from __future__ import annotations

import pytest
import torch

from siesta import LLM, SamplingParams
from siesta.model import l2_prefetch
from siesta.model.l2_prefetch import LINE_BYTES, LINES_PER_ITERATION, StepPrefetch

CUDA = torch.device("cuda")


def _expected_sums(data: torch.Tensor, programs: int) -> list[int]:
    """What program p should have read: the first byte of line l for every line with
    (l // LINES_PER_ITERATION) % programs == p."""
    firsts = data[::LINE_BYTES].to(torch.int64)
    owner = (torch.arange(len(firsts)) // LINES_PER_ITERATION) % programs
    return [int(firsts[owner == p].sum()) for p in range(programs)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's walk (a card prefetches instead)")
@pytest.mark.parametrize(("nbytes", "max_bytes", "programs"), [
    (1, 1 << 20, 4),  # one partial line
    (1000, 1 << 20, 1),  # a partial last line, one program
    (3 * LINES_PER_ITERATION * LINE_BYTES + 200, 1 << 20, 2),  # several loop steps each, ragged end
    (5 * LINES_PER_ITERATION * LINE_BYTES, 2 * LINES_PER_ITERATION * LINE_BYTES + 64, 3),  # capped mid-tensor
])  # fmt: skip
def test_each_program_walks_its_own_lines_and_the_cap_ends_the_walk(nbytes: int, max_bytes: int,
                                                                    programs: int) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    weight = data.view(torch.bfloat16) if nbytes % 2 == 0 else data  # a weight's bytes, whatever its dtype
    sums = l2_prefetch.prefetch(weight, evict_last=False, max_bytes=max_bytes, programs=programs)
    assert sums.tolist() == _expected_sums(data[:max_bytes], programs)


def test_only_small_cuda_steps_prefetch_and_only_with_the_knob_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(l2_prefetch, "_capable", lambda device: True)
    monkeypatch.setattr(l2_prefetch, "MAX_ROWS", 0)
    assert not l2_prefetch.wanted(1, CUDA)  # shipped off
    monkeypatch.setattr(l2_prefetch, "MAX_ROWS", 8)
    assert l2_prefetch.wanted(1, CUDA) and l2_prefetch.wanted(8, CUDA)
    assert not l2_prefetch.wanted(9, CUDA) and not l2_prefetch.wanted(0, CUDA)
    assert not l2_prefetch.wanted(1, torch.device("cpu"))
    assert l2_prefetch.for_step([], 1, torch.device("cpu")) is l2_prefetch.NO_PREFETCH
    # Into a graph being captured; eagerly only the device's first step (the graphs' warm-up:
    # the kernel compiled and loaded outside any capture), then nothing.
    capturing = [False]
    monkeypatch.setattr(l2_prefetch.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(l2_prefetch, "_side_stream", lambda index: "side stream")
    monkeypatch.setattr(l2_prefetch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(l2_prefetch, "_warmed", set())
    assert isinstance(l2_prefetch.for_step([], 1, CUDA), StepPrefetch)
    assert l2_prefetch.for_step([], 1, CUDA) is l2_prefetch.NO_PREFETCH
    capturing[0] = True
    step = l2_prefetch.for_step([], 1, CUDA)
    assert isinstance(step, StepPrefetch) and step.stream == "side stream" and step.windows == l2_prefetch.ENABLED
    monkeypatch.setattr(l2_prefetch, "ENABLED", ())
    assert not l2_prefetch.wanted(1, CUDA)


class _Recorded(StepPrefetch):
    """The real windows, with each issue recorded instead of launched on a side stream."""

    def __init__(self, layers, windows, log: list) -> None:
        super().__init__(layers, stream=None, windows=windows)
        self.log = log

    def _issue(self, weight: torch.Tensor, evict_last: bool) -> None:
        self.log.append(("issue", weight, evict_last))

    def join(self) -> None:
        self.log.append(("join",))


@pytest.mark.parametrize("windows", [("o_proj", "next_qkv"), ("o_proj",), ("next_qkv",)])
def test_a_step_prefetches_each_layers_o_proj_then_the_next_layers_qkv(windows, monkeypatch) -> None:
    """Through a real forward (tiny Qwen3-MoE on the CPU): during layer i's attention its o_proj
    (normal priority), after its o_proj the q/k/v of layer i + 1 (evict_last), none past the last
    layer, and one join at the end; the hidden states are those of a step without prefetches."""
    llm = LLM(model="random:tiny-qwen3-moe", dtype="float32", kv_cache_bytes=16 << 20, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 30))}
    plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    model = llm.engine.runner.model
    layers = model.model.layers
    logs: list[list] = []

    def recorded(layers_arg, rows, device):
        logs.append([])
        return _Recorded(layers_arg, windows, logs[-1])

    monkeypatch.setattr(l2_prefetch, "for_step", recorded)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.logprobs) == (plain.token_ids, plain.logprobs)
    assert len(logs) >= 4  # the prompt's step and each decode step
    expected = []
    for i, layer in enumerate(layers):
        if "o_proj" in windows:
            expected.append(("issue", layer.self_attn.o_proj.weight, False))
        if "next_qkv" in windows and i + 1 < len(layers):
            expected.append(("issue", layers[i + 1].self_attn.qkv_proj.weight, True))
    # A prompt's step keeps its last row only: its last layer runs in halves, after the join.
    prompt_step = [e for e in expected if e[1] is not layers[-1].self_attn.o_proj.weight] + [("join",)]
    for log, want in zip(logs, [prompt_step] + [expected + [("join",)]] * (len(logs) - 1)):
        assert [_key(e) for e in log] == [_key(e) for e in want]


def _key(entry: tuple) -> tuple:
    """A recorded entry with its weight by identity: the very parameter, not an equal tensor."""
    return entry if entry[0] == "join" else ("issue", id(entry[1]), entry[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="L2 prefetches need a card (bench/gpu.sh runs it)")
@pytest.mark.parametrize("model", ["random:tiny-qwen3-moe", "random:tiny-llama"])
def test_the_same_tokens_and_logprobs_with_prefetches_on(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the decode graphs (batch 1 and 3), where the prefetches go, and eager steps, which
    issue none: a prefetch is a cache hint, so other bits would mean a fork or a join in the
    wrong place."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    runs = []
    for rows in (0, 64):
        monkeypatch.setattr(l2_prefetch, "MAX_ROWS", rows)
        for eager in (False, True):
            llm = LLM(model=model, dtype="bfloat16", kv_cache_bytes=256 << 20, enforce_eager=eager)
            outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs])
            del llm
    assert runs[0] == runs[2] and runs[1] == runs[3]
