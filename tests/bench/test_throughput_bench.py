"""The throughput bench's plan: its mixes, and arms measured interleaved on the same prompts."""

from __future__ import annotations

import argparse

from siesta.bench import throughput


def _args(**overrides) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    args = p.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def test_the_two_mixes_are_the_issue_s_and_flags_override_them() -> None:
    mixes = {m.name: m for m in throughput.selected_mixes(_args(mix="both"))}
    assert mixes["prefill-heavy"] == throughput.Mix("prefill-heavy", 32, 150, 1000, 64)
    assert mixes["decode-heavy"] == throughput.Mix("decode-heavy", 64, 100, 1000, 128)
    (only,) = throughput.selected_mixes(_args(mix="prefill-heavy", output_len=8))
    assert (only.name, only.num_prompts, only.output_len) == ("prefill-heavy", 32, 8)


class _RecordingArm:
    """An arm that answers at once and remembers what it was asked to generate."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        self.log.append((self.name, tuple(map(tuple, prompts)), max_tokens))
        return 0.5 * len(prompts) * max_tokens  # any positive time


def test_arms_alternate_and_see_the_same_prompts_each_repeat_and_new_ones_across_repeats() -> None:
    args = _args(mix="both", num_prompts=3, min_prompt_len=4, max_prompt_len=9, output_len=2, prefill_len=12,
                 decode_batches="2", decode_context=5, decode_steps=3)  # fmt: skip
    log: list = []
    arms = {"siesta": _RecordingArm("siesta", log), "transformers": _RecordingArm("transformers", log)}
    todo = throughput.measurements(args, vocab=500)
    samples = throughput.interleave(arms, todo, repeats=2)
    keys = ["decode-heavy_output_tok_s", "prefill-heavy_output_tok_s", "prefill_12_tok_s", "decode_tok_s_batch2"]
    assert [m.key for m in todo] == keys
    assert all(len(samples[a][k]) == 2 for a in arms for k in keys)
    calls_per_repeat = 2 * (1 + 1 + 1 + 2)  # both arms: two mixes, the long prompt, decode's two runs
    assert len(log) == 2 * calls_per_repeat
    first, second = log[:calls_per_repeat], log[calls_per_repeat:]
    assert first[0][0] == "siesta" and second[0][0] == "transformers"  # the order alternates
    for repeat in (first, second):
        by_arm = {a: [c[1:] for c in repeat if c[0] == a] for a in arms}
        assert by_arm["siesta"] == by_arm["transformers"]  # same prompts, same lengths
    prompts = [c[1] for c in log]
    assert not {p for p in prompts[:calls_per_repeat]} & {p for p in prompts[calls_per_repeat:]}
    assert any(len(p) == 1 and len(p[0]) == 12 for p in prompts)  # the long prompt


def test_each_repeat_is_checkpointed_as_medians_and_ratios() -> None:
    args = _args(mix="prefill-heavy", num_prompts=2, min_prompt_len=3, max_prompt_len=5, output_len=2, prefill_len=6,
                 decode_batches="")  # fmt: skip
    log: list = []
    arms = {"siesta": _RecordingArm("siesta", log), "transformers": _RecordingArm("transformers", log)}
    seen: list[int] = []
    result: dict = {}

    def checkpoint(samples) -> None:
        throughput.summarize(result, samples)
        seen.append(len(samples["siesta"]["prefill_6_tok_s"]))

    samples = throughput.interleave(arms, throughput.measurements(args, vocab=300), repeats=3, after_repeat=checkpoint)
    assert seen == [1, 2, 3]
    # The recording arm takes 0.5 s per prompt and token: 2 prompts x 2 tokens -> 4 tok / 2 s.
    assert result["siesta"]["prefill-heavy_output_tok_s"] == 2.0
    assert result["ratios"] == {"prefill-heavy_output_tok_s": 1.0, "prefill_6_tok_s": 1.0}
    assert result["transformers_samples"] == samples["transformers"]
