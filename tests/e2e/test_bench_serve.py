"""``siesta bench serve`` against a live server: every request succeeds, the table is printed."""

from __future__ import annotations

import json

from siesta.entrypoints.cli import main

NUM_PROMPTS = 4
OUTPUT_LEN = 4


def test_bench_serve_reports_latency_and_throughput(dev_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    main(["bench", "serve", "--url", dev_server.url, "--num-prompts", str(NUM_PROMPTS), "--input-len", "32",
          "--output-len", str(OUTPUT_LEN), "--max-concurrency", "2", "--request-rate", "20",
          "--result-json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "Successful requests:", "Mean TTFT (ms):", "P99 TPOT (ms):",
                 "Median ITL (ms):", "Output token throughput (tok/s):"):  # fmt: skip
        assert line in printed, line
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == NUM_PROMPTS and summary["failed"] == 0
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert summary["total_input_tokens"] == NUM_PROMPTS * 32
    assert 0 < summary["mean_ttft_ms"] and 0 < summary["mean_itl_ms"]


def test_bench_serve_text_prompts(dev_server, tmp_path):
    out = tmp_path / "serve.json"
    main(["bench", "serve", "--url", dev_server.url, "--num-prompts", "2", "--input-len", "16", "--output-len", "2",
          "--prompt-format", "text", "--result-json", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["summary"]["completed"] == 2
