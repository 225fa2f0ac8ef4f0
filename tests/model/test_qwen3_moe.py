"""Qwen3-MoE against an independent oracle: transformers' own ``Qwen3MoeForCausalLM`` with
transformers' default initialisation (not siesta's random init), in fp32 on the CPU.

The trainer is that model, built under a seed from the ``tiny-qwen3-moe`` shape (and variants
with a dense layer among the sparse ones, and with ``decoder_sparse_step`` 2 and unnormalised
top-k weights). Its weights reach the engine pushed (``update_weights`` with its state dict:
experts stacked ``[E, 2I, H]`` and ``[E, H, I]``) or saved (``save_pretrained``: one tensor per
expert and projection) and served. Checked against it:

1. prompt and greedy decode logprobs, to 1e-4 at every position, for a batch of prompts long
   enough to be prefilled in several chunks;
2. the engine's routing (``return_routed_experts``) is transformers' router's top-k except at
   near-ties, and transformers forced to the engine's routing gives the engine's logprobs;
3. tensor parallel 2 (gloo ranks, every expert cut along its intermediate features) is tensor
   parallel 1 within fp32 noise, pushed and read from the checkpoint;
4. the three expert naming schemes trainers push land the same weights;
5. a push naming an expert the model lacks, or a tensor of the wrong shape, or a checkpoint of
   other experts, is refused by name before anything is written.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from siesta import LLM, SamplingParams
from siesta.bench import fidelity
from siesta.bench.fidelity import Scored
from siesta.model.random_init import RANDOM_SHAPES
from siesta.weight_transfer import WeightSender, WeightTransferError

TOLERANCE = 1e-4  # fp32 on both sides
TP_NOISE = 1e-5  # tensor parallel 2 against 1: the same fp32 sums in another order
# Router probabilities this close are a tie to fp32: the engine and transformers may pick either.
NEAR_TIE = 1e-6
# A change that a test must see: one token routed to another expert in one layer moves logprobs by
# 8e-4 to 2e-2 here, every token by ~3e-2; other weights by far more.
VISIBLE = 10 * TOLERANCE

SHAPE = RANDOM_SHAPES["tiny-qwen3-moe"]
VARIANTS = {
    "all-sparse": {},
    "dense-layer-1": {"mlp_only_layers": [1]},
    "sparse-step-2-unnormed": {"decoder_sparse_step": 2, "norm_topk_prob": False},  # layer 1 alone is sparse
}
TP_VARIANT = "dense-layer-1"
SEED, OTHER_SEED, BAD_SEED = 0, 1, 2

PROMPT_LEN, BATCH, DECODE = 320, 4, 8
CHUNK = 64  # the step's token budget: the long prompt takes five chunks or more, the others two or more
SMALL_PROMPT_LEN, SMALL_BATCH, SMALL_DECODE = 96, 2, 4  # for the pushes' before-and-after checks
KV_BYTES = 1 << 23


def moe_config(variant: str) -> PretrainedConfig:
    return AutoConfig.for_model(SHAPE.model_type, **(SHAPE.params | VARIANTS[variant]))


def trainer(variant: str, seed: int = SEED) -> torch.nn.Module:
    return fidelity.trainer_model(moe_config(variant), "cpu", seed=seed)


def engine(model: str, tp: int = 1, **kw) -> LLM:
    return LLM(model, dtype="float32", device="cpu", kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK,
               max_model_len=PROMPT_LEN + 2 * DECODE, enable_return_routed_experts=True, tensor_parallel_size=tp,
               **kw)  # fmt: skip


def served_config(variant: str, tmp: Path) -> str:
    """``random:DIR`` of the trainer's architecture: siesta's own weights until a push."""
    return fidelity.config_folder(moe_config(variant), tmp / f"config-{variant}")


def prompts(length: int = PROMPT_LEN, batch: int = BATCH) -> list[list[int]]:
    return fidelity.batch_prompts(length, batch, SHAPE.params["vocab_size"], seed=7)


# -- the engine's side ----------------------------------------------------------------------


@dataclass
class Run:
    scored: list[Scored]
    routing: list[np.ndarray]  # per request [tokens - 1, layers, k]: prompt then output
    cached: list[int]  # prompt tokens each found in the prefix cache

    def logprobs(self) -> list[list[float]]:
        return [s.prompt_lp + s.decode_lp for s in self.scored]


def generate(llm: LLM, batch: list[list[int]], decode: int = DECODE, score_prompts: bool = True) -> Run:
    """Greedy decode with sampled logprobs (and the prompts', unless ``score_prompts`` is off: a
    scored prompt takes nothing from the prefix cache) and the routing, all requests in one batch."""
    params = SamplingParams(max_tokens=decode, temperature=0, logprobs=0, ignore_eos=True, return_routed_experts=True,
                            prompt_logprobs=0 if score_prompts else None)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    scored, routing = [], []
    for p, out in zip(batch, outs, strict=True):
        gen = out.outputs[0]
        assert len(gen.token_ids) == decode
        prompt_lp = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))] if score_prompts else []
        decode_lp = [gen.logprobs[j][t].logprob for j, t in enumerate(gen.token_ids)]
        scored.append(Scored(p, list(gen.token_ids), prompt_lp, decode_lp))
        routing.append(gen.routed_experts.array())
    return Run(scored, routing, [out.num_cached_tokens for out in outs])


def rank0_experts(llm: LLM) -> dict[str, torch.Tensor]:
    """Rank 0's MLP parameters (experts, routers, the dense layer's), as they are now."""
    model = llm.engine.runner.model
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}


def rank0_parameters(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.runner.model.named_parameters()}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


# -- transformers' side ---------------------------------------------------------------------


def sparse_layers(model: torch.nn.Module) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]


@dataclass
class Reference:
    logprobs: list[float]  # position i scores ids[i + 1]
    best: list[float]  # the largest logprob at position i
    router_probs: dict[int, torch.Tensor]  # sparse layer -> [tokens, experts] fp32 softmax of the router


@torch.inference_mode()
def reference(model: torch.nn.Module, ids: list[int]) -> Reference:
    """transformers' logprobs of ``ids`` and each sparse layer's router probabilities."""
    captured: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        return lambda _module, _args, out: captured.__setitem__(layer, torch.softmax(out[0], -1, dtype=torch.float32))

    with _hooks(model, {i: keep(i) for i in sparse_layers(model)}):
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1)
    picked = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return Reference(picked.tolist(), logp.max(-1).values.tolist(), captured)


@torch.inference_mode()
def forced_logprobs(model: torch.nn.Module, ids: list[int], routing: np.ndarray, norm_topk_prob: bool) -> list[float]:
    """transformers' logprobs of ``ids`` with every sparse layer routed as ``routing`` says
    (``[len(ids) - 1, layers, k]``; the last token routes as its router says): the router's own
    probabilities at those experts, renormalised where ``norm_topk_prob`` says."""

    def force(layer: int):
        def hook(_module, _args, out):
            logits, _, own = out
            chosen = own.clone()
            chosen[: routing.shape[0]] = torch.from_numpy(routing[:, layer].astype(np.int64))
            weights = torch.softmax(logits, -1, dtype=torch.float32).gather(1, chosen)
            if norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return hook

    with _hooks(model, {i: force(i) for i in sparse_layers(model)}):
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@contextlib.contextmanager
def _hooks(model: torch.nn.Module, by_layer: dict) -> Iterator[None]:
    handles = [model.model.layers[i].mlp.gate.register_forward_hook(hook) for i, hook in by_layer.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def assert_is_the_trainer(run: Run, model: torch.nn.Module, label: str) -> float:
    """Every prompt and decode logprob within TOLERANCE of transformers', each decoded token the
    oracle's greedy choice (up to TOLERANCE); returns the largest error."""
    worst = 0.0
    for s in run.scored:
        ref = reference(model, s.ids)
        got = s.prompt_lp + s.decode_lp
        assert len(got) == len(ref.logprobs)
        errors = [abs(a - b) for a, b in zip(got, ref.logprobs)]
        worst = max(worst, *errors)
        at = int(np.argmax(errors))
        assert errors[at] <= TOLERANCE, f"{label}: position {at} ({len(s.prompt)}-token prompt) off by {errors[at]:.1e}"
        n = len(s.prompt)
        for j in range(len(s.generated)):
            assert ref.logprobs[n - 1 + j] >= ref.best[n - 1 + j] - TOLERANCE, f"{label}: decode {j} is not greedy"
    return worst


# -- the experts' names -----------------------------------------------------------------


_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def per_expert(state: dict[str, torch.Tensor], joined: bool) -> dict[str, torch.Tensor]:
    """transformers' stacked experts as one tensor per expert: ``gate_proj``/``up_proj``/``down_proj``
    (checkpoints), or with ``joined`` gate and up as one ``gate_up_proj`` (siesta's sender's ``fuse``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _STACKED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, proj = match["prefix"], match["proj"]
        for e, expert in enumerate(tensor):
            if proj == "down_proj" or joined:
                out[f"{prefix}.{e}.{proj}.weight"] = expert
            else:
                gate, up = expert.chunk(2, dim=0)  # gate rows first
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out


# -- 1. logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_pushed_trainer_is_served_to_every_position(variant, tmp_path):
    model = trainer(variant)
    llm = engine(served_config(variant, tmp_path))
    llm.update_weights(model.state_dict())  # the trainer's own names: experts stacked
    batch = prompts()
    assert max(len(p) for p in batch) > 4 * CHUNK  # prefilled in chunks, beside the others' decodes
    run = generate(llm, batch)
    assert_is_the_trainer(run, model, f"{variant} push")
    # Read back by the engine's parameters: the push wrote the trainer's experts whole.
    params = llm.engine.runner.model.parameter_table()
    state = model.state_dict()
    for i in sparse_layers(model):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            assert torch.equal(params[name], state[name]), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_saved_checkpoint_is_served_to_every_position(variant, tmp_path):
    model = trainer(variant)
    model.save_pretrained(tmp_path / "ckpt")
    saved = _checkpoint(tmp_path / "ckpt")
    # What this test reads is what checkpoints hold: one tensor per expert and projection, gate
    # and up apart (the test's own split of the stacked tensors is transformers').
    split = per_expert(model.state_dict(), joined=False)
    assert not any(_STACKED.match(n) for n in saved) and any(".experts.7.up_proj." in n for n in saved)
    assert saved.keys() == split.keys() and all(torch.equal(saved[n], split[n]) for n in saved)
    run = generate(engine(str(tmp_path / "ckpt")), prompts())
    assert_is_the_trainer(run, model, f"{variant} checkpoint")


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - a safetensors handle
    return tensors


# -- 2. routing ----------------------------------------------------------------------------


def routing_disagreements(routing: np.ndarray, ref: Reference, top_k: int) -> tuple[int, list[str]]:
    """(disagreements, those not at a near-tie): where the engine's ordered top-k ids of a token
    in a sparse layer are not the top-k of transformers' router probabilities."""
    total, unexplained = 0, []
    for layer, probs in ref.router_probs.items():
        rows = probs[: routing.shape[0]]
        ordered = torch.sort(rows, -1, descending=True)
        want = ordered.indices[:, :top_k].numpy()
        differ = np.flatnonzero((routing[:, layer] != want).any(-1))
        gaps = (ordered.values[:, :top_k] - ordered.values[:, 1 : top_k + 1]).min(-1).values  # within top-k+1
        total += len(differ)
        unexplained += [f"layer {layer} token {t}: engine {routing[t, layer]} transformers {want[t]} "
                        f"(closest gap {gaps[t]:.1e})" for t in differ if gaps[t] > NEAR_TIE]  # fmt: skip
    return total, unexplained


def test_only_a_near_tie_excuses_a_routing_disagreement():
    """The comparison's own check (the engine and transformers agree on every token here, so
    nothing else exercises its excuse): a swap across a tie within NEAR_TIE is excused, within
    the top k or at its edge; one across a real gap is not."""
    probs = torch.tensor([[0.4, 0.3, 0.3 - NEAR_TIE / 2, 0.0], [0.4, 0.4 - NEAR_TIE / 2, 0.2, 0.0],
                          [0.5, 0.3, 0.2, 0.0]])  # fmt: skip
    ref = Reference([], [], {0: probs})
    engine_ids = np.array([[[0, 2]], [[1, 0]], [[0, 2]]])  # a tie at the k-th, a tie in the order, no tie
    total, unexplained = routing_disagreements(engine_ids, ref, top_k=2)
    assert total == 3 and len(unexplained) == 1 and unexplained[0].startswith("layer 0 token 2:")


@pytest.mark.parametrize("variant", ["dense-layer-1", "sparse-step-2-unnormed"])
def test_the_routing_is_the_routers_and_replays_the_engine(variant, tmp_path):
    model, config = trainer(variant), moe_config(variant)
    llm = engine(served_config(variant, tmp_path))
    llm.update_weights(model.state_dict())
    batch = prompts()
    run = generate(llm, batch)
    sparse, k = sparse_layers(model), config.num_experts_per_tok
    dense = [i for i in range(config.num_hidden_layers) if i not in sparse]
    assert dense and sparse
    compared = disagreements = 0
    for s, routing, engine_lp in zip(run.scored, run.routing, run.logprobs()):
        assert routing.shape == (len(s.ids) - 1, config.num_hidden_layers, k)
        assert (routing[:, dense] == -1).all()  # a dense layer routes nowhere
        ref = reference(model, s.ids)
        total, unexplained = routing_disagreements(routing, ref, k)
        assert not unexplained, unexplained[:5]
        compared, disagreements = compared + len(routing) * len(sparse), disagreements + total
        # Replayed: transformers routed as the engine was computes the engine's logprobs.
        forced = forced_logprobs(model, s.ids, routing, config.norm_topk_prob)
        assert max_diff([forced], [engine_lp]) <= TOLERANCE
    assert disagreements <= compared // 100, (disagreements, compared)  # ties are rare, not a way out
    # The replay sees a routing that is not the engine's: each token sent to its (k+1)-th expert
    # instead of its k-th in one layer moves the logprobs far past the tolerance.
    s, routing = run.scored[0], run.routing[0]
    wrong = routing.copy()
    probs = reference(model, s.ids).router_probs[sparse[0]][: len(routing)]
    wrong[:, sparse[0], k - 1] = torch.argsort(probs, -1, descending=True)[:, k].numpy()
    assert max_diff([forced_logprobs(model, s.ids, wrong, config.norm_topk_prob)], [run.logprobs()[0]]) > VISIBLE


def test_routing_read_from_the_prefix_cache_is_what_was_computed(tmp_path):
    """A prompt's blocks computed by an earlier request serve its routing too (same weights,
    same content): the second run's rows equal the first's."""
    llm = engine(served_config(TP_VARIANT, tmp_path))
    llm.update_weights(trainer(TP_VARIANT).state_dict())
    batch = prompts(SMALL_PROMPT_LEN, SMALL_BATCH)
    first, again = (generate(llm, batch, SMALL_DECODE, score_prompts=False) for _ in range(2))
    assert all(c >= SMALL_PROMPT_LEN // 2 for c in again.cached)
    assert [s.generated for s in again.scored] == [s.generated for s in first.scored]
    for a, b in zip(first.routing, again.routing, strict=True):
        assert np.array_equal(a, b)


# -- 3. tensor parallelism ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> Iterator[LLM]:
    llm = engine(served_config(TP_VARIANT, tmp_path_factory.mktemp("tp2")), tp=2)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def tp1(tmp_path_factory) -> LLM:
    return engine(served_config(TP_VARIANT, tmp_path_factory.mktemp("tp1")), weight_transfer_config={"backend": "ipc"})


def test_tensor_parallel_2_is_tensor_parallel_1(tp1, tp2, tmp_path):
    model = trainer(TP_VARIANT)
    assert tp2.get_world_size() == 2
    assert tp2.engine.runner.model.expert_range == (0, SHAPE.params["moe_intermediate_size"] // 2)
    batch = prompts()
    runs = {}
    for tp, llm in ((1, tp1), (2, tp2)):
        llm.update_weights(model.state_dict())
        runs[tp] = generate(llm, batch)
    assert [s.generated for s in runs[2].scored] == [s.generated for s in runs[1].scored]
    assert max_diff(runs[2].logprobs(), runs[1].logprobs()) <= TP_NOISE
    assert_is_the_trainer(runs[2], model, "tp2 push")
    top_k = moe_config(TP_VARIANT).num_experts_per_tok
    for s, routing in zip(runs[2].scored, runs[2].routing):  # rank 0 reports what every rank routed
        _, unexplained = routing_disagreements(routing, reference(model, s.ids), top_k)
        assert not unexplained, unexplained[:5]
    # The checkpoint, read by each rank itself: per-expert tensors, each rank its features of each.
    other = trainer(TP_VARIANT, OTHER_SEED)
    other.save_pretrained(tmp_path / "ckpt")
    tp1.update_weights(str(tmp_path / "ckpt"))
    tp2.update_weights(str(tmp_path / "ckpt"))
    single, split = generate(tp1, batch), generate(tp2, batch)
    assert [s.generated for s in split.scored] == [s.generated for s in single.scored]
    assert max_diff(split.logprobs(), single.logprobs()) <= TP_NOISE
    assert_is_the_trainer(split, other, "tp2 checkpoint")


# -- 4. naming schemes ----------------------------------------------------------------------


SCHEMES = {
    "stacked": lambda state: state,
    "per-expert": lambda state: per_expert(state, joined=False),
    "per-expert-joined": lambda state: per_expert(state, joined=True),
}


@pytest.mark.parametrize("tp", [1, 2])
def test_every_naming_scheme_lands_the_same_weights(tp, tp1, tp2):
    llm = tp1 if tp == 1 else tp2
    model, other = trainer(TP_VARIANT), trainer(TP_VARIANT, OTHER_SEED)
    batch = prompts(SMALL_PROMPT_LEN, SMALL_BATCH)
    llm.update_weights(model.state_dict())
    want_params, want = rank0_experts(llm), generate(llm, batch, SMALL_DECODE)
    assert_is_the_trainer(want, model, f"tp{tp} stacked")
    for scheme, rename in SCHEMES.items():
        llm.update_weights(other.state_dict())  # other weights first, so a push that lands nothing shows
        assert max_diff(generate(llm, batch, SMALL_DECODE).logprobs(), want.logprobs()) > VISIBLE
        pushed = rename(model.state_dict())
        assert any(".experts.3." in n for n in pushed) == (scheme != "stacked")
        llm.update_weights(pushed)
        assert same_tensors(rank0_experts(llm), want_params), scheme
        got = generate(llm, batch, SMALL_DECODE)
        assert [s.generated for s in got.scored] == [s.generated for s in want.scored], scheme
        assert max_diff(got.logprobs(), want.logprobs()) == 0.0, scheme  # the same weights, the same sums


# -- 5. bad input ---------------------------------------------------------------------------


def _bad_pushes() -> dict[str, tuple[str, torch.Tensor]]:
    """One bad tensor each: (name, tensor)."""
    c = moe_config(TP_VARIANT)
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    prefix = "model.layers.2.mlp.experts"
    return {
        "expert-past-the-end-gate": (f"{prefix}.{e}.gate_proj.weight", torch.zeros(i, h)),
        "expert-past-the-end-down": (f"{prefix}.{e}.down_proj.weight", torch.zeros(h, i)),
        "expert-past-the-end-joined": (f"{prefix}.{e + 5}.gate_up_proj.weight", torch.zeros(2 * i, h)),
        "stacked-gate-up-without-up": (f"{prefix}.gate_up_proj", torch.zeros(e, i, h)),
        "stacked-down-transposed": (f"{prefix}.down_proj", torch.zeros(e, i, h)),
        "stacked-too-few-experts": (f"{prefix}.gate_up_proj", torch.zeros(e - 1, 2 * i, h)),
    }


BAD_PUSHES = _bad_pushes()


def _assert_refused(llm: LLM, call, needle: str, errors: tuple[type[Exception], ...]) -> None:
    """``call`` raises one of ``errors`` naming ``needle``; nothing changed on any rank (rank 0's
    parameters, and every rank's through the logprobs), the version is the same, it serves on."""
    batch = prompts(SMALL_PROMPT_LEN, SMALL_BATCH)
    before, version, served = rank0_parameters(llm), llm.get_weight_version(), generate(llm, batch, SMALL_DECODE)
    with pytest.raises(errors) as err:
        call()
    assert needle in str(err.value)
    assert same_tensors(rank0_parameters(llm), before)
    assert llm.get_weight_version() == version
    assert generate(llm, batch, SMALL_DECODE).logprobs() == served.logprobs()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_a_bad_push_is_refused_by_name_before_anything_is_written(case, tp, tp1, tp2):
    llm = tp1 if tp == 1 else tp2
    llm.update_weights(trainer(TP_VARIANT).state_dict())
    name, tensor = BAD_PUSHES[case]
    # Every other tensor differs from what is served and comes first: a writer that went
    # tensor by tensor would have changed the weights before reaching the bad one.
    state = dict(trainer(TP_VARIANT, BAD_SEED).state_dict()) | {name: tensor}
    said = repr(name) if "expert-past" in case else name  # "checkpoint tensor 'NAME': expert 8 is not among..."
    _assert_refused(llm, lambda: llm.update_weights(state), said, (ValueError,))


@pytest.mark.parametrize("case", ["expert-past-the-end-down", "stacked-gate-up-without-up"])
def test_a_bad_push_over_the_wire_is_refused_by_name(case, tp1):
    tp1.update_weights(trainer(TP_VARIANT).state_dict())
    name, tensor = BAD_PUSHES[case]
    state = dict(trainer(TP_VARIANT, BAD_SEED).state_dict()) | {name: tensor}
    sender = WeightSender(tp1, "ipc")
    sender.init()
    try:
        _assert_refused(tp1, lambda: sender.send(state), name, (WeightTransferError,))
    finally:
        sender.close()


@pytest.mark.parametrize(("change", "said"), [
    ({"num_experts": 16}, "num_experts 16 (served: 8)"),
    ({"moe_intermediate_size": 64}, "moe_intermediate_size 64 (served: 32)"),
    ({"mlp_only_layers": [0]}, "sparse_layers (1, 2) (served: (0, 2))"),
])  # fmt: skip
def test_a_checkpoint_of_other_experts_is_refused_before_it_is_read(change, said, tp1, tmp_path):
    """Its config is checked first: reading it would write the tensors that fit, then stop."""
    tp1.update_weights(trainer(TP_VARIANT).state_dict())
    config = AutoConfig.for_model(SHAPE.model_type, **(SHAPE.params | VARIANTS[TP_VARIANT] | change))
    fidelity.trainer_model(config, "cpu", seed=BAD_SEED).save_pretrained(tmp_path / "other")
    _assert_refused(tp1, lambda: tp1.update_weights(str(tmp_path / "other")), said, (WeightTransferError,))
