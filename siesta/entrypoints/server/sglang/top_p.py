"""slime's ``custom_params: {"return_top_p_token_ids": true}``: each sampled token's top-p set.

The set is the tokens the sampler could have drawn at that position (siesta's nucleus: min_p,
then top_k, then the tokens whose mass ranked strictly above them is below top_p, over the
survivors renormalised), likeliest first; a greedy row's is the token itself. As slime's SGLang
patch reports them, they ride in ``meta_info`` once the request finished: ``top_p_token_ids``
(every position's set, concatenated) and ``top_p_token_offsets`` (one more than the tokens,
from 0), each base64 of little-endian int32; and the sampled tokens' logprobs are renormalised
over their set (plus the token itself) when ``return_logprob`` asks for them.

The sets come from the distribution the sampler reports (``scaled_logprobs``: over the
temperature, before truncation), whose likeliest ``MAX_LOGPROBS`` tokens the request asks for.
A set that does not end among those cannot be known here: that position falls back to the
sampled token alone, as SGLang's own patch does past its cap, and ``top_p_token_ids_truncated``
counts such positions, so the fallback is never silent. Rows with no filter at all (top_p 1, no
top_k or min_p) report no sets, as SGLang's.
"""

from __future__ import annotations

import base64
import logging
import math
import struct
from dataclasses import dataclass
from typing import Any

from siesta.request import Logprob
from siesta.sampling import GREEDY_TEMPERATURE_EPS, MAX_LOGPROBS, TOP_K_DISABLED

logger = logging.getLogger(__name__)
FLAG = "return_top_p_token_ids"
# How many alternatives a request asks the sampler for when it wants its sets.
CANDIDATES = MAX_LOGPROBS


@dataclass(frozen=True)
class Nucleus:
    """One request's truncation rule, replayed on the logprobs the sampler reported."""

    greedy: bool
    top_p: float
    top_k: int  # 0: off
    min_p: float

    @classmethod
    def of(cls, params: Any) -> Nucleus | None:
        """The rule of ``params`` (SamplingParams or SGLang's: temperature, top_p, top_k, min_p),
        or None for a request that truncates nothing (no sets are reported)."""
        greedy = params.temperature < GREEDY_TEMPERATURE_EPS
        top_k = 0 if params.top_k in TOP_K_DISABLED else params.top_k
        if not greedy and params.top_p >= 1.0 and top_k == 0 and params.min_p <= 0.0:
            return None
        return cls(greedy, params.top_p, top_k, params.min_p)

    def kept(self, entries: dict[int, Logprob], sampled: int) -> list[int] | None:
        """The set at one position, likeliest first; None when it does not end among ``entries``."""
        if self.greedy:
            return [sampled]
        ranked = sorted(entries.items(), key=lambda kv: -kv[1].logprob)
        reported = [(t, lp.logprob) for t, lp in ranked if lp.rank is None or lp.rank <= CANDIDATES]
        if not reported:
            return None
        survivors = reported
        if self.min_p > 0.0:
            floor = reported[0][1] + math.log(self.min_p)
            survivors = [(t, lp) for t, lp in survivors if lp >= floor]
        if self.top_k:
            if self.top_k > len(reported):
                return None  # top-k leaves tokens the sampler did not report
            kth = reported[self.top_k - 1][1]  # ties with the k-th stay in, as the sampler keeps them
            survivors = [(t, lp) for t, lp in survivors if lp >= kth]
        # The survivors' total mass: known when nothing was cut (the reported logprobs are
        # normalised over the vocabulary), or when every survivor was reported.
        cut = self.min_p > 0.0 or self.top_k
        complete = len(survivors) < len(reported) or self.top_k
        if cut and not complete:
            return None
        total = sum(math.exp(lp) for _, lp in survivors) if cut else 1.0
        if self.top_p >= 1.0:
            return [t for t, _ in survivors]
        kept, above = [], 0.0
        for token, lp in survivors:
            if kept and above >= self.top_p:
                return kept
            kept.append(token)
            above += math.exp(lp) / total
        return kept if cut or above >= self.top_p else None


@dataclass
class TopPSets:
    """Every position's set of one answer, as slime's patch encodes them."""

    token_ids: list[int]
    offsets: list[int]
    truncated: int

    @classmethod
    def of(cls, nucleus: Nucleus, sampled: list[int], entries: list[dict[int, Logprob]]) -> TopPSets:
        token_ids: list[int] = []
        offsets = [0]
        truncated = 0
        for token, entry in zip(sampled, entries):
            kept = nucleus.kept(entry, token)
            if kept is None:
                kept, truncated = [token], truncated + 1
            elif token not in kept:  # the sampler's boundary and this replay may differ by rounding
                kept = [*kept, token]
            token_ids.extend(kept)
            offsets.append(len(token_ids))
        if truncated:
            logger.warning("top-p sets of %d of %d tokens lie beyond the %d reported alternatives: "
                           "those positions report the sampled token alone", truncated, len(sampled), CANDIDATES)  # fmt: skip
        return cls(token_ids, offsets, truncated)

    def renormalised(self, index: int, sampled: int, entry: dict[int, Logprob]) -> float:
        """The sampled token's logprob over its set (SGLang's patch: the set plus the token)."""
        members = self.token_ids[self.offsets[index] : self.offsets[index + 1]]
        values = [entry[t].logprob for t in members if t in entry]
        if not values:
            return 0.0
        top = max(values)
        return entry[sampled].logprob - (top + math.log(sum(math.exp(v - top) for v in values)))

    def meta(self) -> dict[str, Any]:
        return {
            "top_p_token_ids": _int32_base64(self.token_ids),
            "top_p_token_offsets": _int32_base64(self.offsets),
            "top_p_token_ids_truncated": self.truncated,  # siesta's: positions that fell back
        }


def _int32_base64(values: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode("ascii")
