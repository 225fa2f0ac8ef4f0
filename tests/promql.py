"""The metric series a PromQL expression reads, and the queries of a Grafana dashboard.

A small scanner, not a parser: it walks the expression once, skipping what cannot name a
series (strings, label matchers, range and subquery brackets, label lists after by /
without / on / ignoring / group_left / group_right, numbers, durations, Grafana variables)
and keeps every other identifier that is not a function, an aggregation or a keyword. An
identifier followed by "(" that is not a known function is an error, not a series: the
check must not pass because a typo hid a name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

# Prometheus' functions (https://prometheus.io/docs/prometheus/latest/querying/functions/).
FUNCTIONS = frozenset((
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time", "ceil",
    "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month", "day_of_week",
    "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "histogram_avg", "histogram_count",
    "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar", "histogram_sum",
    "holt_winters", "double_exponential_smoothing", "hour", "idelta", "increase", "info", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time",
    "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets",
    "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year",
))  # fmt: skip
AGGREGATIONS = frozenset((
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
    "limitk", "limit_ratio",
))  # fmt: skip
# Followed by a parenthesised list of label names, which name no series.
LABEL_LIST_KEYWORDS = frozenset(("by", "without", "on", "ignoring", "group_left", "group_right"))
KEYWORDS = frozenset(("and", "or", "unless", "bool", "offset", "atan2", "inf", "nan")) | LABEL_LIST_KEYWORDS

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(0x[0-9A-Fa-f]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(?:ms|s|m|h|d|w|y)*")
_VARIABLE = re.compile(r"\$(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")
_CLOSING = {"{": "}", "[": "]", "(": ")"}


def _skip_string(expr: str, i: int) -> int:
    """Index past the string literal that starts at ``i``."""
    quote = expr[i]
    i += 1
    while i < len(expr) and expr[i] != quote:
        i += 2 if expr[i] == "\\" and quote != "`" else 1
    if i >= len(expr):
        raise ValueError(f"unterminated string in {expr!r}")
    return i + 1


def _skip_group(expr: str, i: int) -> int:
    """Index past the bracketed group (``{...}``, ``[...]``, ``(...)``) that starts at ``i``."""
    close = _CLOSING[expr[i]]
    i += 1
    while i < len(expr) and expr[i] != close:
        i = _skip_string(expr, i) if expr[i] in "\"'`" else i + 1
    if i >= len(expr):
        raise ValueError(f"unclosed {close!r} in {expr!r}")
    return i + 1


def _next_char(expr: str, i: int) -> str:
    while i < len(expr) and expr[i].isspace():
        i += 1
    return expr[i] if i < len(expr) else ""


def series_names(expr: str) -> set[str]:
    """Every metric series ``expr`` selects (a histogram's ``_bucket`` series as written)."""
    names: set[str] = set()
    i = 0
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c in "\"'`":
            i = _skip_string(expr, i)
        elif c in "{[":
            if "__name__" in expr[i : _skip_group(expr, i)]:
                raise ValueError(f"a matcher on __name__ hides which series {expr!r} reads")
            i = _skip_group(expr, i)
        elif c == "$":
            match = _VARIABLE.match(expr, i)
            if match is None:
                raise ValueError(f"a bare $ in {expr!r}")
            i = match.end()
        elif c.isdigit() or (c == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
            i = _NUMBER.match(expr, i).end()
        elif _IDENT.match(expr, i):
            word = _IDENT.match(expr, i).group()
            i += len(word)
            lowered = word.lower()
            if lowered in LABEL_LIST_KEYWORDS:
                while i < len(expr) and expr[i].isspace():
                    i += 1
                if i < len(expr) and expr[i] == "(":
                    i = _skip_group(expr, i)  # label names, not series
            elif lowered in KEYWORDS or lowered in AGGREGATIONS:
                continue
            elif _next_char(expr, i) == "(":
                if word not in FUNCTIONS:
                    raise ValueError(f"{word!r} in {expr!r} is called but is no PromQL function")
            else:
                names.add(word)
        else:
            i += 1  # operators, commas, parentheses
    return names


def dashboard_queries(dashboard: dict) -> Iterator[str]:
    """Every PromQL expression of a dashboard: panel targets (rows' panels too) and the series
    that query variables read through ``label_values(series, label)``."""
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", query)
        if match is None:
            raise ValueError(f"variable {variable['name']!r}: only label_values(series, label) is understood")
        yield match.group(1)


def dashboard_series(path: Path) -> set[str]:
    names: set[str] = set()
    for expr in dashboard_queries(json.loads(path.read_text())):
        names |= series_names(expr)
    return names


def exposition_samples(text: str) -> set[str]:
    """Names of the samples in a Prometheus text exposition (``# HELP``/``# TYPE`` lines left out)."""
    return {_IDENT.match(line).group() for line in text.splitlines() if line and not line.startswith("#")}


def exposition_families(text: str) -> set[str]:
    """Names every ``# TYPE`` line declares, with the series a family of that type exposes."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    out: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            out.update(base + s for s in suffixes.get(kind, ("",)))
    return out
