"""The frontend's view of a request: outputs that arrive together change a request once."""

from __future__ import annotations

from siesta.metrics import MetricsRegistry
from siesta.output_processor import OutputProcessor
from siesta.request import EngineCoreOutput, SampledLogprobs
from siesta.sampling import SamplingParams


def test_several_steps_in_one_batch_change_a_request_once():
    """A stream reader that falls behind gets several steps at once; listing the request once per
    step made the stream send one finishing chunk per step (3 of 4 chunks said "length")."""
    processor = OutputProcessor(None, MetricsRegistry())
    processor.add("r", None, [1, 2], SamplingParams(max_tokens=3))
    processor.add("s", None, [1], SamplingParams(max_tokens=3))
    batch = [EngineCoreOutput("r", [5]), EngineCoreOutput("s", [6]), EngineCoreOutput("r", [7]),
             EngineCoreOutput("r", [8], finish_reason="length")]  # fmt: skip
    changed, _ = processor.process(batch)
    assert [s.request_id for s in changed] == ["r", "s"]
    assert changed[0].token_ids == [5, 7, 8] and changed[0].finish_reason == "length"
    delta = OutputProcessor.completion(changed[0], delta=True)
    assert delta.token_ids == [5, 7, 8] and OutputProcessor.completion(changed[0], delta=True).token_ids == []


class CharTokenizer:
    """Token i is the i-th character of ``CHARS``; its decode is the oracle of the text."""

    CHARS = "xab.cd"

    def decode(self, ids, **_) -> str:
        return "".join(self.CHARS[i] for i in ids)


class NoDecode:
    def decode(self, ids, **_):
        raise AssertionError("detokenize=False must not decode")


def test_detokenize_false_keeps_token_ids_and_does_no_text_work():
    processor = OutputProcessor(NoDecode(), MetricsRegistry())
    state = processor.add("r", None, [1, 2], SamplingParams(detokenize=False, logprobs=1))
    lp = SampledLogprobs(token_id=4, logprob=-0.5, rank=1, top=[(4, -0.5)])
    processor.process([EngineCoreOutput("r", [4], new_logprobs=[lp]), EngineCoreOutput("r", [5], finish_reason="length",
                       new_logprobs=[lp])])  # fmt: skip
    out = OutputProcessor.completion(state)
    assert (out.text, out.token_ids) == ("", [4, 5])
    assert out.logprobs[0][4].decoded_token is None and out.logprobs[0][4].logprob == -0.5


def test_a_delta_never_sends_text_that_a_stop_string_later_cuts():
    """Stop "ab" spans two tokens: "a" arrives first and must be held back (vLLM keeps
    len(stop) - 1 characters back), or a delta reader would see "xa" while the text is "x"."""
    processor = OutputProcessor(CharTokenizer(), MetricsRegistry())
    state = processor.add("r", None, [0], SamplingParams(stop=["ab"], max_tokens=10))
    sent = []
    for token in [0, 1, 2, 3]:  # x a b .
        processor.process([EngineCoreOutput("r", [token])])
        sent.append(OutputProcessor.completion(state, delta=True).text)
        if state.finished:
            break
    assert state.finish_reason == "stop" and state.text == "x"
    assert sent == ["", "x", ""] and "".join(sent) == state.text


def test_deltas_concatenate_to_the_text_when_nothing_stops():
    processor = OutputProcessor(CharTokenizer(), MetricsRegistry())
    state = processor.add("r", None, [0], SamplingParams(stop=["zz"], max_tokens=4))
    pieces = []
    for i, token in enumerate([1, 3, 4, 5]):
        finish = "length" if i == 3 else None
        processor.process([EngineCoreOutput("r", [token], finish_reason=finish)])
        pieces.append(OutputProcessor.completion(state, delta=True).text)
    assert pieces == ["", "a", ".", "cd"] and "".join(pieces) == state.text == "a.cd"
