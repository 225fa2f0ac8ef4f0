"""The frontend's view of a request: outputs that arrive together change a request once."""

from __future__ import annotations

from siesta.metrics import MetricsRegistry
from siesta.output_processor import OutputProcessor
from siesta.request import EngineCoreOutput
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
