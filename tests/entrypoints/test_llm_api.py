"""The offline API: prompt forms, sampling options, text, and bad input that leaves the engine serving."""

from __future__ import annotations

import pytest
import torch

from siesta import LLM, SamplingParams
from siesta.config import ConfigError
from siesta.control import RequestRejected

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm():
    # A small KV cache, so that "can never fit" is reachable: 64 blocks of 16 tokens.
    return LLM(dtype="float32", max_model_len=2048, kv_cache_bytes=64 * 16 * 30 * 2 * 3 * 64 * 4)


def texts(outs):
    return [o.outputs[0].text for o in outs]


def test_prompt_forms_agree(llm):
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    ids = tok.encode(text)
    by_text = llm.generate(text, GREEDY, use_tqdm=False)[0]
    by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    by_list = llm.generate([text, text], GREEDY, use_tqdm=False)
    assert by_text.prompt_token_ids == ids and by_text.prompt == text
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_list[1].outputs[0].token_ids
    # Text is the tokenizer's own decoding of the tokens (incremental detokenization is exact).
    assert by_text.outputs[0].text == tok.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids[0] == llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")
    assert "Paris" in out.outputs[0].text


def test_stop_strings_cut_the_text(llm):
    prompt = "Count: one, two, three, four, five, six,"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    stop = full.text.split()[2]  # a word the greedy output is known to contain
    before = llm.get_metrics()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    after = llm.get_metrics()
    # Counted as it answered: stopped, not aborted (the core ends it as the front end asks).
    for reason, delta in (("stop", 1), ("abort", 0)):
        key = f'siesta_request_success_total{{finished_reason="{reason}"}}'
        assert after.get(key, 0) - before.get(key, 0) == delta, key
    assert b"_created" not in llm.metrics.exposition()  # as vLLM: no timestamp series
    assert out.text == full.text[: full.text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_eos_min_tokens_and_ignore_eos(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(short.token_ids) + 3),
                      use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    assert not set(longer.token_ids[: len(short.token_ids) + 2]) & llm.engine.eos_token_ids
    ignored = llm.chat(chat, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 20 and ignored.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    a = llm.generate(["Once upon a time", "Hello"], params, use_tqdm=False)
    b = llm.generate(["Hello", "Once upon a time", "x"], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids
    multi = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7), use_tqdm=False)[0]
    assert [o.index for o in multi.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in multi.outputs}) == 3


def test_logprobs_shape(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, step in zip(out.token_ids, out.logprobs):
        assert token in step and step[token].rank == 1  # greedy picks the top token
        assert len(step) == 3 and all(lp.logprob <= 0 for lp in step.values())
    assert out.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs)))


def test_cache_salt_separates_prefix_caches(llm):
    prompt = "A fairly long shared prompt. " * 20
    llm.generate(prompt, GREEDY, use_tqdm=False)
    before = llm.get_metrics()["siesta_prefix_cache_hits_total"]
    llm.generate({"prompt": prompt, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)
    assert llm.get_metrics()["siesta_prefix_cache_hits_total"] == before
    llm.generate({"prompt": prompt, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)
    assert llm.get_metrics()["siesta_prefix_cache_hits_total"] > before


def test_metrics_names(llm):
    m = llm.get_metrics()
    for name in ["siesta_prefix_cache_queries_total", "siesta_prefix_cache_hits_total", "siesta_prompt_tokens_total",
                 "siesta_generation_tokens_total", "siesta_num_requests_running", "siesta_kv_cache_usage_perc",
                 "siesta_time_to_first_token_seconds_count", "siesta_weight_version"]:  # fmt: skip
        assert name in m


# -- vLLM's sampling fields: logit_bias, allowed_token_ids, bad_words, truncation, output --

FRANCE = "The capital of France is"
SHORT = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def france(llm):
    """The plain greedy continuation: the oracle the fields below are measured against."""
    out = llm.generate(FRANCE, SHORT, use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text  # the bad-words test below needs the word to be there
    return out


def test_bias_allowed_ids_and_bad_words_steer_greedy_output(llm, france):
    tok = llm.get_tokenizer()
    allowed = tok.encode(" yes no")
    params = [
        SHORT.replace(logit_bias={france.token_ids[0]: -100.0}),
        SHORT.replace(allowed_token_ids=allowed),
        SHORT.replace(bad_words=["Paris"]),
        SHORT,  # a plain row in the same batch keeps its output
    ]
    biased, restricted, banned, plain = (o.outputs[0] for o in llm.generate([FRANCE] * 4, params, use_tqdm=False))
    assert biased.token_ids[0] != france.token_ids[0] and biased.token_ids[1:] != france.token_ids[1:]
    assert set(restricted.token_ids) <= set(allowed)
    assert "Paris" not in banned.text and banned.token_ids != france.token_ids
    assert plain.token_ids == france.token_ids


def test_truncate_prompt_tokens_equals_sending_the_truncated_prompt(llm, france):
    tok = llm.get_tokenizer()
    ids = tok.encode(FRANCE)
    k = len(ids)
    long_text = "Some words that the truncation drops. " * 3 + FRANCE
    tail = tok.encode(long_text)[-k:]  # the text's own last tokens ("The" after ". " is " The")
    truncated = SHORT.replace(truncate_prompt_tokens=k)
    text_out, tail_out, ids_out = llm.generate(
        [long_text, {"prompt_token_ids": tail}, {"prompt_token_ids": [7] * 9 + ids}],
        [truncated, SHORT, truncated],
        use_tqdm=False,
    )
    assert text_out.prompt_token_ids == tail and text_out.outputs[0].token_ids == tail_out.outputs[0].token_ids
    assert ids_out.prompt_token_ids == ids and ids_out.outputs[0].token_ids == france.token_ids
    whole = llm.generate(FRANCE, SHORT.replace(truncate_prompt_tokens=-1), use_tqdm=False)[0]  # -1: max_model_len
    assert whole.prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be <= max_model_len=2048"):
        llm.generate(FRANCE, SHORT.replace(truncate_prompt_tokens=2049), use_tqdm=False)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm, france):
    out = llm.generate(FRANCE, SHORT.replace(detokenize=False, logprobs=1), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == france.token_ids and out.text == ""
    assert all(entry.decoded_token is None for step in out.logprobs for entry in step.values())


def test_output_kinds_of_step(llm, france):
    """Through add_request + step, as vLLM's LLMEngine: DELTA outputs concatenate to the CUMULATIVE
    one, FINAL_ONLY produces only the finished output; generate() returns whole outputs anyway."""
    from siesta.sampling import RequestOutputKind as Kind

    ids = {kind: llm.add_request(FRANCE, SHORT.replace(output_kind=kind)) for kind in Kind}
    seen: dict[str, list] = {rid: [] for rid in ids.values()}
    while llm.has_unfinished_requests():
        for out in llm.step():
            seen[out.request_id].append(out)
    cumulative, delta, final = (seen[ids[kind]] for kind in (Kind.CUMULATIVE, Kind.DELTA, Kind.FINAL_ONLY))
    assert cumulative[-1].outputs[0].token_ids == france.token_ids and len(cumulative) > 1
    assert [t for out in delta for t in out.outputs[0].token_ids] == france.token_ids
    assert "".join(out.outputs[0].text for out in delta) == france.text
    assert len(delta) == len(cumulative) and [o.finished for o in delta][-2:] == [False, True]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == france.token_ids
    whole = llm.generate(FRANCE, SHORT.replace(output_kind=Kind.DELTA), use_tqdm=False)[0].outputs[0]
    assert whole.token_ids == france.token_ids


def test_bad_field_token_ids_are_refused_by_name(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(RequestRejected, match=f"^logit_bias holds token id {vocab}, outside the vocabulary"):
        llm.generate(FRANCE, SHORT.replace(logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(RequestRejected, match="^allowed_token_ids holds token id"):
        llm.generate(FRANCE, SHORT.replace(allowed_token_ids=[0, vocab + 5]), use_tqdm=False)
    from siesta.request import EngineCoreRequest

    with pytest.raises(RequestRejected, match="bad_words were not tokenized"):  # the core has no tokenizer
        llm.engine.add_request(EngineCoreRequest("untokenized", [1, 2], SHORT.replace(bad_words=["x"])))


# -- bad input -----------------------------------------------------------------------------


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(RequestRejected, match=r"3000 tokens but max_model_len is 2048"):
        llm.generate({"prompt_token_ids": [5] * 3000}, GREEDY, use_tqdm=False)
    assert texts(llm.generate("Hi", GREEDY, use_tqdm=False))


def test_request_that_can_never_fit_the_kv_cache(llm):
    # 64 blocks hold 1,024 tokens; this prompt fits max_model_len but never the cache.
    with pytest.raises(RequestRejected, match=r"needs 95 KV blocks \(1511 tokens\) but the cache holds only 64 blocks"):
        llm.generate({"prompt_token_ids": [5] * 1500}, GREEDY, use_tqdm=False)
    assert texts(llm.generate("Hi", GREEDY, use_tqdm=False))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"min_p": 2}, "min_p"), ({"logprobs": 99}, "logprobs"), ({"n": 0}, "n"), ({"stop": [""]}, "stop")],
)  # fmt: skip
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bad", [10**9, -1, 2**63, 2.5])  # past the vocabulary, negative, past int64, not an int
def test_bad_token_ids_are_named(llm, bad):
    with pytest.raises(RequestRejected, match=f"^prompt token id {bad!r} is outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, bad, 2]}, GREEDY, use_tqdm=False)


def test_bad_token_ids_and_empty_prompts(llm):
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**9]}, GREEDY, use_tqdm=False)
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)


def test_bad_prompt_in_a_batch_adds_nothing_and_in_flight_requests_go_on(llm):
    rid = llm.add_request("Tell me about the sea.", SamplingParams(temperature=0, max_tokens=8))
    llm.step()
    with pytest.raises(RequestRejected):
        llm.generate(["Fine prompt", {"prompt_token_ids": [5] * 3000}], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_running == 1  # only the in-flight request; the batch left nothing
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    assert done[0].request_id == rid and len(done[0].outputs[0].token_ids) == 8


def test_unknown_model_path():
    with pytest.raises(ValueError, match="random:"):
        LLM("/no/such/model")


def test_bad_engine_config():
    with pytest.raises(ConfigError, match="block_size"):
        LLM("random:tiny-llama", block_size=12)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM("random:tiny-llama", max_model_len=10**7)


def test_async_scheduling_is_an_engine_flag_of_the_cli_and_the_llm():
    import argparse

    from siesta.entrypoints.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def flag(*argv: str) -> bool | None:
        config = engine_config(parser.parse_args(["--model", "random:tiny-llama", *argv]))
        config.validate(max_model_len=64)
        return config.scheduler.async_scheduling

    assert flag("--async-scheduling") is True
    assert flag("--no-async-scheduling") is False
    assert LLM("random:tiny-llama", async_scheduling=True).config.scheduler.async_scheduling


def test_async_scheduling_defaults_on_where_the_device_runs_ahead_of_the_host():
    from siesta.config import EngineConfig

    for device, expected in (("cpu", False), ("cuda", True)):
        config = EngineConfig.from_flags(model="random:tiny-llama", device=device)
        assert config.scheduler.async_scheduling is None  # not chosen until the device is known
        config.validate(max_model_len=64)
        assert config.scheduler.async_scheduling is expected
    on_cuda = torch.cuda.is_available()  # LLM's own default device
    assert LLM("random:tiny-llama").config.scheduler.async_scheduling is on_cuda
