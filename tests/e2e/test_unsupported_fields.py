"""A field of OpenAI's or vLLM's that siesta does not implement is refused by name, unless it is
off; a field no one defines is ignored. Never a 200 that silently did less than asked."""

from __future__ import annotations

import httpx
import pytest

COMPLETION = {"prompt": "Hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("route", "base", "field", "value"),
    [
        ("/v1/completions", COMPLETION, "suffix", " the end"),
        ("/v1/completions", COMPLETION, "use_beam_search", True),
        ("/v1/completions", COMPLETION, "best_of", 3),
        ("/v1/chat/completions", CHAT, "echo", True),  # chat's echo is not completions' (which is done)
        ("/v1/chat/completions", CHAT, "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/chat/completions", CHAT, "guided_json", {"type": "object"}),
    ],
)
def test_an_unimplemented_field_is_refused_by_name(dev_server, route, base, field, value):
    r = httpx.post(f"{dev_server.url}{route}", json=base | {field: value}, timeout=60)
    assert r.status_code == 400 and f"{field} is not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("route", "base", "extra"),
    [
        ("/v1/completions", COMPLETION, {"echo": False, "suffix": None, "best_of": 1}),
        ("/v1/chat/completions", CHAT,
         {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "echo": False}),
        ("/v1/completions", COMPLETION, {"x_my_tracing_id": "abc"}),  # no one's field: ignored
    ],
)
def test_off_values_and_unknown_fields_pass(dev_server, route, base, extra):
    assert httpx.post(f"{dev_server.url}{route}", json=base | extra, timeout=60).status_code == 200
