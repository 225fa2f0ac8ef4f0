"""fp8 KV cache scales on trained weights: vLLM's default 1.0 against ``--calculate-kv-scales``.

    python -m siesta.bench.fp8_scales [--model PATH] [--device cpu] [--tokens 1024] [--json PATH]

The model (default: the embedded SmolLM2-135M-Instruct, trained weights) scores the same text
three times: with its own KV dtype (the reference), and with an fp8 e4m3 cache under scales of
1.0 and under scales computed from the calibration prompt. The text is English prose (this
repository's DESIGN.md, cut into prompts of ``--tokens`` tokens), not random ids. Per fp8 arm:
the largest and the mean |logprob difference| from the reference over every prompt position and
the greedy continuation, and the share of the reference's greedy tokens it reproduces; with each
layer's K and V amax against the format's range (what decides whether 1.0 wastes it).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from siesta.bench.common import machine, print_table, release_memory, write_json
from siesta.bench.fidelity import engine_scores

DESIGN_TEXT = Path(__file__).resolve().parents[2] / "DESIGN.md"
ARMS = {"reference": {}, "fp8 scales 1.0": {"kv_cache_dtype": "fp8"},
        "fp8 calculated scales": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}}  # fmt: skip
DECODE_TOKENS = 16


def text_prompts(tokenizer, tokens: int, count: int) -> list[list[int]]:
    ids = tokenizer.encode(DESIGN_TEXT.read_text(), add_special_tokens=False)
    return [ids[i * tokens : (i + 1) * tokens] for i in range(min(count, len(ids) // tokens))]


def run(model: str | None, device: str, tokens: int, count: int) -> dict[str, Any]:
    from siesta import LLM

    out: dict[str, Any] = {"model": model or "embedded", "tokens": tokens, "machine": machine()}
    scores: dict[str, list] = {}
    for arm, flags in ARMS.items():
        llm = LLM(model, device=device, max_model_len=tokens + DECODE_TOKENS + 16, **flags)
        prompts = text_prompts(llm.get_tokenizer(), tokens, count)
        scores[arm] = engine_scores(llm, prompts, DECODE_TOKENS)
        scales = llm.engine.runner.kv_scales
        if scales is not None:
            out[f"{arm} scales"] = {"origin": scales.origin, "k": list(scales.k), "v": list(scales.v)}
        del llm
        release_memory()
    ref = scores["reference"]
    for arm in list(ARMS)[1:]:
        diffs, same = [], 0
        for r, s in zip(ref, scores[arm], strict=True):
            diffs += [abs(a - b) for a, b in zip(r.prompt_lp, s.prompt_lp, strict=True)]
            same += sum(a == b for a, b in zip(r.generated, s.generated, strict=True))
        out[arm] = {"max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": statistics.fmean(diffs),
                    "positions": len(diffs), "greedy_tokens_reproduced": same / (len(ref) * DECODE_TOKENS)}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens a prompt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run(args.model, args.device, args.tokens, args.prompts)
    rows = [[arm, res[arm]["max_abs_logprob_diff"], res[arm]["mean_abs_logprob_diff"],
             res[arm]["greedy_tokens_reproduced"]] for arm in list(ARMS)[1:]]  # fmt: skip
    print_table(f"fp8 KV scales, {res['model']}, {args.prompts} x {args.tokens} tokens of prose",
                ["arm", "max |d logprob|", "mean |d logprob|", "greedy tokens as the reference"], rows)  # fmt: skip
    write_json(args.json, res)


if __name__ == "__main__":
    main()
