"""The batched sampler: one step's logits in, one token (and its logprobs) per row out.

Order of operations is vLLM's (v1 sampler):

1. logprobs, when asked for, come from the raw model logits: nothing below changes them;
2. allowed_token_ids: every other token to -inf;
3. bans to -inf: EOS and stop ids before min_tokens, and bad words (the last token of a
   bad word whose earlier tokens the output ends with);
4. logit_bias added;
5. penalties: repetition, then frequency and presence;
6. argmax (greedy rows), or temperature, min_p, top_k, top_p and a random draw.

Bans before the bias or after it come to the same: a finite bias leaves -inf alone.
Every stage works on the whole batch at once, building flat ``row * vocab + token``
positions for one index_fill / index_add / index_copy, and costs nothing when no row
uses it; Python loops run over rows (and a row's few bad words), never the vocabulary.

A seeded row draws its randomness only from its own generator, always the
same amount per step, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from siesta.core.staging import HostCopy, to_device, to_device_many
from siesta.model import batch_invariant
from siesta.request import PromptLogprobs
from siesta.sampling import SamplingParams

# Rows are picked with ``tensor[index]`` throughout: CPU index_select is ~20x slower on wide rows.
NEG_INF = float("-inf")

# On CPU a full sort of a 128k vocabulary costs ~10 ms a row, topk(1024) ~0.7 ms and
# topk(16384) ~2.5 ms: top-p looks for its nucleus among the likeliest 1024 tokens,
# then 16384, and sorts only rows whose nucleus is larger still. On CUDA sorting is
# cheap and each check would sync, so CUDA sorts at once.
TOP_P_CANDIDATES = (1024, 16384)
# A uniform draw of exactly 0 would make -log(u) infinite and tie every token at -inf.
MIN_UNIFORM = torch.finfo(torch.float32).tiny


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    generator: torch.Generator | None  # None: the sampler's shared generator
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    banned_token_ids: Sequence[int] = ()  # e.g. EOS and stop ids before min_tokens


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # of the sampled token, when logprobs were requested
    rank: int | None = None  # 1-based, under the raw distribution; ties count in its favour
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # highest first


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A seeded request's own generator; it must live on the logits' device."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Samples one token per row; owns the generator that unseeded rows share."""

    def __init__(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        if device is not None:
            self.shared_generator(torch.device(device))

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded rows on ``device``, created on first use."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._shared:
            self._shared[device] = make_generator(self.seed, device)
        return self._shared[device]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        return self.sample(logits, rows).results()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], prompt: PromptScores | None = None) -> PendingSamples:
        """Launch the sampling; the tokens stay on the device until ``results`` is called.
        The step's ``prompt`` scores, if any, come back in the same copy."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        logits = logits.float().contiguous()
        raw = _RawLogprobs.compute(logits, rows)
        processed = apply_allowed_token_ids(logits, rows)
        processed = apply_logit_bias(apply_bans(processed, rows), rows)
        processed = apply_penalties(processed, rows)
        if raw is not None:
            raw.scale(processed, rows)
        return PendingSamples(self._choose_tokens(processed, rows), raw, rows, prompt)

    def _choose_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            return _argmax(logits)
        if len(sampled) == len(rows):
            return self._sample(logits, rows)
        tokens = _argmax(logits)
        index = _device_tensor(sampled, torch.int64, logits.device)
        tokens[index] = self._sample(logits[index], [rows[i] for i in sampled])
        return tokens

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        filtered = filter_logits(logits, [row.params for row in rows])
        return self._exponential_race(filtered, [row.generator for row in rows])

    def _exponential_race(self, logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        # argmax(p / E) with E ~ Exp(1) draws from p; in log space that is
        # argmax(logits - log E), which needs no softmax. E = -log(U) because
        # uniform_ is ~4x faster than exponential_ on CPU.
        uniform = self._uniform_noise(logits, generators)
        log_exponential = uniform.clamp_min_(MIN_UNIFORM).log_().neg_().log_()
        return _argmax(logits - log_exponential)

    def _uniform_noise(self, logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(logits)
        shared = self.shared_generator(logits.device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            return noise.uniform_(generator=shared)
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].uniform_(generator=generator)
        if unseeded:
            index = _device_tensor(unseeded, torch.int64, logits.device)
            draw = torch.empty((len(unseeded), logits.shape[1]), device=logits.device).uniform_(generator=shared)
            noise.index_copy_(0, index, draw)
        return noise


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    from siesta.core.argmax import argmax_rows  # Triton is loaded on first CUDA use only

    return argmax_rows(logits)


# -- logits processing (public so tests can check each stage against an oracle) --------


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` with every token outside a row's ``allowed_token_ids`` at -inf (a new tensor when
    any row has the field; rows without it keep all their tokens)."""
    chosen = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if not chosen:
        return logits
    index = _device_tensor(chosen, torch.int64, logits.device)
    subset = logits[index]  # a contiguous copy, so its flat view is safe to read
    positions = _token_positions([(rows[i].params.allowed_token_ids,) for i in chosen], logits.shape[1], logits.device)
    allowed = torch.full_like(subset, NEG_INF)
    allowed.view(-1).index_copy_(0, positions, subset.view(-1)[positions])
    return allowed if len(chosen) == len(rows) else logits.index_copy(0, index, allowed)


def bad_word_bans(bad_words_token_ids: Sequence[Sequence[int]] | None, output_token_ids: Sequence[int]) -> list[int]:
    """The tokens a row's bad words forbid next: a word's last token, where the output so far
    ends with the word's earlier tokens (a one-token word always). vLLM matches the output
    only, not the prompt, so a word begun in the prompt is not finished off here either."""
    if not bad_words_token_ids:
        return []
    n = len(output_token_ids)
    bans = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix <= n and (prefix == 0 or list(output_token_ids[n - prefix :]) == list(word[:-1])):
            bans.append(word[-1])
    return bans


def apply_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` with each row's banned tokens (``banned_token_ids`` and its bad words' next
    tokens) at -inf (a new tensor when any are banned)."""
    banned = [(row.banned_token_ids, bad_word_bans(row.params.bad_words_token_ids, row.output_token_ids)) for row in rows]
    if not any(len(ids) for parts in banned for ids in parts):
        return logits
    positions = _token_positions(banned, logits.shape[1], logits.device)
    banned_logits = logits.clone(memory_format=torch.contiguous_format)
    banned_logits.view(-1).index_fill_(0, positions, NEG_INF)
    return banned_logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` plus each row's ``logit_bias`` (a new tensor when any row has one)."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return logits
    biases = [rows[i].params.logit_bias for i in biased]
    token_ids = np.fromiter((t for bias in biases for t in bias), dtype=np.int64)
    values = np.fromiter((v for bias in biases for v in bias.values()), dtype=np.float32)
    row_ids = np.repeat(np.asarray(biased, dtype=np.int64), [len(bias) for bias in biases])
    vocab = logits.shape[1]
    in_vocab = (token_ids >= 0) & (token_ids < vocab)  # as _token_positions: odd ids never fail a step
    positions, added = to_device_many(
        [torch.from_numpy(row_ids[in_vocab] * vocab + token_ids[in_vocab]), torch.from_numpy(values[in_vocab])],
        logits.device,
    )
    # A dict holds each token once, so no position repeats: the sum is deterministic on CUDA too.
    return logits.clone(memory_format=torch.contiguous_format).view(-1).index_add_(0, positions, added).view_as(logits)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (HF semantics, prompt + output), then frequency and presence (output only).

    Only the logits of tokens a row has seen change, so the work gathers and
    scatters those few instead of making passes over the whole vocabulary.
    A token seen twice appears twice in the scatter, but both copies carry the
    same value, so the result is deterministic on CUDA too.
    """
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return logits
    index = _device_tensor(penalised, torch.int64, logits.device)
    updated = logits[index]  # a contiguous copy, so its flat view is safe to write
    subset = [rows[i] for i in penalised]
    _repetition_penalty(updated, subset)
    _additive_penalties(updated, subset)
    return updated if len(penalised) == len(rows) else logits.index_copy(0, index, updated)


def _repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    if all(row.params.repetition_penalty == 1.0 for row in rows):
        return
    vocab = logits.shape[1]
    positions = _token_positions([(row.prompt_token_ids, row.output_token_ids) for row in rows], vocab, logits.device)
    penalty = _device_tensor([row.params.repetition_penalty for row in rows], torch.float32, logits.device)
    penalty = penalty[positions // vocab]
    seen = logits.view(-1)[positions]
    # HF: shrink what the model likes (divide positives), deepen what it dislikes.
    logits.view(-1).index_copy_(0, positions, torch.where(seen > 0, seen / penalty, seen * penalty))


def _additive_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    if all(row.params.presence_penalty == 0.0 and row.params.frequency_penalty == 0.0 for row in rows):
        return
    vocab = logits.shape[1]
    positions = _token_positions([(row.output_token_ids,) for row in rows], vocab, logits.device)
    row_of = positions // vocab
    frequency = _device_tensor([row.params.frequency_penalty for row in rows], torch.float32, logits.device)[row_of]
    presence = _device_tensor([row.params.presence_penalty for row in rows], torch.float32, logits.device)[row_of]
    # A dense count table rather than unique(): its output size would sync CUDA.
    table = torch.zeros(logits.numel(), device=logits.device)
    counts = table.index_add_(0, positions, torch.ones_like(positions, dtype=table.dtype))[positions]
    flat = logits.view(-1)
    flat.index_copy_(0, positions, flat[positions] - frequency * counts - presence)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p; a new tensor, -inf where excluded. Rows must not be greedy."""
    temperature = _column([p.temperature for p in params], logits.device)
    filtered = logits / temperature
    _apply_min_p(filtered, params)
    _apply_top_k(filtered, params)
    _apply_top_p(filtered, params)
    return filtered


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    if not any(p.min_p > 0.0 for p in params):
        return
    # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed.
    log_min_p = _column([math.log(p.min_p) if p.min_p > 0.0 else NEG_INF for p in params], logits.device)
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    logits.masked_fill_(logits < threshold, NEG_INF)


def _apply_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    vocab = logits.shape[1]
    ks = [p.top_k if p.top_k_enabled and p.top_k < vocab else 0 for p in params]
    max_k = max(ks)
    if max_k == 0:
        return
    top_values = logits.topk(max_k, dim=-1).values
    kth_index = _device_tensor([max(k, 1) - 1 for k in ks], torch.int64, logits.device).unsqueeze(1)
    kth = top_values.gather(1, kth_index)
    enabled = _device_tensor([k > 0 for k in ks], torch.bool, logits.device).unsqueeze(1)
    # Ties with the k-th value stay in, like vLLM.
    threshold = torch.where(enabled, kth, torch.full_like(kth, NEG_INF))
    logits.masked_fill_(logits < threshold, NEG_INF)


def _apply_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    chosen = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if not chosen:
        return
    index = _device_tensor(chosen, torch.int64, logits.device)
    top_p = _column([params[i].top_p for i in chosen], logits.device)
    every_row = len(chosen) == len(params)
    subset = logits if every_row else logits[index]
    probs = batch_invariant.softmax(subset)
    keep = _top_p_keep(probs, top_p, _top_k_bound([params[i] for i in chosen], logits.shape[1]))
    subset.masked_fill_(~keep, NEG_INF)
    if not every_row:
        logits.index_copy_(0, index, subset)


def _top_k_bound(params: list[SamplingParams], vocab: int) -> int | None:
    """The most tokens top-k left any of these rows, when every one of them has top-k on."""
    if all(p.top_k_enabled and p.top_k < vocab for p in params):
        return max(p.top_k for p in params)
    return None


def _top_p_keep(probs: torch.Tensor, top_p: torch.Tensor, top_k_bound: int | None) -> torch.Tensor:
    """The nucleus: a token stays while the mass ranked strictly above it is below top_p."""
    vocab = probs.shape[1]
    if top_k_bound is not None:
        # Top-k already zeroed everything else (ties with the k-th aside): no sort needed.
        keep, _ = _nucleus_among(probs, top_p, top_k_bound)
        return keep
    if probs.device.type != "cpu":
        keep, _ = _nucleus_among(probs, top_p, vocab)
        return keep
    keep = torch.zeros_like(probs, dtype=torch.bool)
    pending = torch.arange(probs.shape[0])
    for candidates in (*TOP_P_CANDIDATES, vocab):
        stage_keep, covered = _nucleus_among(probs[pending], top_p[pending], min(candidates, vocab))
        keep[pending] = stage_keep
        if candidates >= vocab or bool(covered.all()):
            break
        pending = pending[~covered]
    return keep


def _nucleus_among(probs: torch.Tensor, top_p: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus found among the ``candidates`` likeliest tokens, and whether it fits there."""
    if candidates >= probs.shape[1]:
        top_probs, top_ids = probs.sort(dim=-1, descending=True)
    else:
        top_probs, top_ids = probs.topk(candidates, dim=-1)
    cumulative = top_probs.cumsum(dim=-1)
    keep_sorted = (cumulative - top_probs) < top_p
    keep_sorted[:, 0] = True  # rounding must never empty a row
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top_ids, keep_sorted)
    covered = cumulative[:, -1] >= top_p.squeeze(1)
    return keep, covered


# -- logprobs ---------------------------------------------------------------------------


@dataclass
class _RawLogprobs:
    """log_softmax of the raw logits for the rows that asked for logprobs (or, for rows that
    want ``scaled_logprobs``, of their processed logits over the temperature)."""

    rows: list[int]
    index: torch.Tensor
    logprobs: torch.Tensor  # [len(rows), vocab]

    @classmethod
    def compute(cls, logits: torch.Tensor, rows: list[SamplingRow]) -> _RawLogprobs | None:
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not wanted:
            return None
        index = _device_tensor(wanted, torch.int64, logits.device)
        selected = logits if len(wanted) == len(rows) else logits[index]
        return cls(wanted, index, batch_invariant.log_softmax(selected))

    def scale(self, processed: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Rows with ``scaled_logprobs`` report the distribution they sample from instead:
        the processed logits over the temperature (SGLang's default)."""
        scaled = [j for j, i in enumerate(self.rows) if rows[i].params.scaled_logprobs and not rows[i].params.greedy]
        if not scaled:
            return
        at = _device_tensor(scaled, torch.int64, processed.device)
        source = _device_tensor([self.rows[j] for j in scaled], torch.int64, processed.device)
        temperature = _column([rows[self.rows[j]].params.temperature for j in scaled], processed.device)
        self.logprobs.index_copy_(0, at, batch_invariant.log_softmax(processed[source] / temperature))


def _ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """1-based ranks of ``chosen`` ([rows, 1]) in each row; ties count in its favour."""
    # Summing floats is ~2x faster than bools on CPU and exact below 2**24 tokens.
    return (logprobs > chosen).float().sum(dim=-1) + 1


def score_tokens(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under log_softmax of the raw logits: each row's token's logprob and rank, and the
    row's ``top_n`` (ids, values), highest first."""
    logprobs = batch_invariant.log_softmax(logits.float())
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    top_values, top_ids = logprobs.topk(top_n, dim=-1)
    return chosen.squeeze(1), _ranks(logprobs, chosen), top_ids, top_values


@dataclass
class PromptSpan:
    """One request's rows of a step's prompt scores: prompt tokens [first, first + count)."""

    first: int
    count: int
    top_n: int


@dataclass
class PromptScores:
    """A step's prompt logprobs on the device: ``score_tokens`` of every span's rows, in order."""

    spans: list[PromptSpan]
    logprobs: torch.Tensor  # [rows]
    ranks: torch.Tensor  # [rows]
    top_ids: torch.Tensor  # [rows, top_n]
    top_values: torch.Tensor  # [rows, top_n]

    @classmethod
    def concat(cls, spans: list[PromptSpan], chunks: list[tuple[torch.Tensor, ...]]) -> PromptScores:
        """The scores of row chunks (each a ``score_tokens`` result), one after another."""
        parts = [chunks[0][k] if len(chunks) == 1 else torch.cat([c[k] for c in chunks]) for k in range(4)]
        return cls(spans, *parts)

    @property
    def top_n(self) -> int:
        return self.top_ids.shape[1]

    def parts(self) -> list[torch.Tensor]:
        return [self.logprobs, self.ranks, self.top_ids, self.top_values]

    def results(self, host_parts: list[list]) -> list[PromptLogprobs]:
        """Each span's scores from the host copies of ``parts``."""
        logprobs, ranks, top_ids, top_values = host_parts
        width, row, out = self.top_n, 0, []
        for span in self.spans:
            rows = range(row, row + span.count)
            top = [_top_of(top_ids, top_values, r * width, span.top_n) for r in rows] if span.top_n else []
            out.append(PromptLogprobs(span.first, logprobs[row : rows.stop], [int(ranks[r]) for r in rows], top))
            row = rows.stop
        return out


def _top_of(ids: list, values: list, start: int, n: int) -> list[tuple[int, float]]:
    """The first ``n`` (id, value) pairs of one row of flat host copies, from ``start``."""
    return [(int(t), v) for t, v in zip(ids[start : start + n], values[start : start + n])]


class PendingSamples:
    """A step's samples, launched: ``tokens`` on the device (a next step may read its inputs
    from there) and their copy to the host under way; ``results`` waits for that copy alone.

    A step's prompt scores, if it has any, travel in the same copy.
    """

    def __init__(
        self, tokens: torch.Tensor, raw: _RawLogprobs | None, rows: list[SamplingRow], prompt: PromptScores | None = None
    ) -> None:
        self.tokens = tokens
        self._rows = rows
        self._raw = raw
        self._prompt = prompt
        self._top_n = 0
        self._host_parts: list[list] | None = None
        if raw is None and prompt is None:
            self._copy = HostCopy(tokens)
            return
        parts = [tokens]
        if raw is not None:
            self._top_n = max(rows[i].params.logprobs or 0 for i in raw.rows)
            sampled = raw.logprobs.gather(1, tokens[raw.index].unsqueeze(1))
            top_values, top_ids = raw.logprobs.topk(self._top_n, dim=-1)
            parts += [sampled, _ranks(raw.logprobs, sampled), top_ids, top_values]
        if prompt is not None:
            parts += prompt.parts()
        # One copy for all of them: float64 holds token ids and ranks (< 2**53) and float32
        # logprobs exactly.
        self._sizes = [t.numel() for t in parts]
        self._copy = HostCopy(torch.cat([t.reshape(-1).double() for t in parts]))

    def _parts(self) -> list[list]:
        """The copy, landed, cut back into its parts."""
        if self._host_parts is None:
            flat = self._copy.wait()
            starts = [sum(self._sizes[:k]) for k in range(len(self._sizes))]
            self._host_parts = [flat[start : start + size] for start, size in zip(starts, self._sizes)]
        return self._host_parts

    def results(self) -> list[SampleResult]:
        if self._raw is None and self._prompt is None:
            return [SampleResult(token_id=t) for t in self._copy.wait()]
        parts = self._parts()
        results = [SampleResult(token_id=int(t)) for t in parts[0]]
        if self._raw is None:
            return results
        sampled_list, rank_list, id_list, value_list = parts[1:5]
        top_n = self._top_n
        for j, i in enumerate(self._raw.rows):
            n = self._rows[i].params.logprobs or 0
            top = slice(j * top_n, j * top_n + n)
            results[i].logprob, results[i].rank = sampled_list[j], int(rank_list[j])
            results[i].top_logprobs = [(int(t), v) for t, v in zip(id_list[top], value_list[top])]
        return results

    def prompt_results(self) -> list[PromptLogprobs]:
        """The step's prompt scores, one per span (waits for the copy)."""
        if self._prompt is None:
            return []
        return self._prompt.results(self._parts()[-len(self._prompt.parts()) :])


# -- helpers ------------------------------------------------------------------------------


def _device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device``."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _device_tensor(values, torch.float32, device).unsqueeze(1)


def _token_positions(
    parts_per_row: Sequence[tuple[Sequence[int], ...]], vocab: int, device: torch.device
) -> torch.Tensor:
    """``row * vocab + token`` for every token of every row: indexes into ``logits.view(-1)``.

    Built on the host with numpy, which converts a list at ~30 ns a token and takes
    int64 arrays (numpy, ``array('q')``, CPU tensors) without a per-token loop.
    """
    arrays = [[np.asarray(part, dtype=np.int64) for part in parts] for parts in parts_per_row]
    lengths = [sum(array.size for array in row_arrays) for row_arrays in arrays]
    token_ids = np.concatenate([array for row_arrays in arrays for array in row_arrays])
    rows = np.repeat(np.arange(len(arrays), dtype=np.int64), lengths)
    # Like HF, ids the logits cannot hold (an embedding larger than the LM head) are
    # skipped: the model never emits them, and one odd id must not fail the whole step.
    in_vocab = (token_ids >= 0) & (token_ids < vocab)
    positions = rows[in_vocab] * vocab + token_ids[in_vocab]
    return to_device(torch.from_numpy(positions), device)
