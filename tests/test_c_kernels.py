"""siesta/c_kernels.py: builds keyed by the ISA the compiler targets (not the CPU's model name), a
failing build recorded once and not retried, concurrent builds of one kernel compiled once, and
builds for another -march. The compiler is gcc behind a wrapper that logs each call."""

from __future__ import annotations

import logging
import os
import platform
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from siesta import c_kernels
from siesta.cache_dir import CACHE_DIR_ENV
from siesta.c_kernels import CFLAGS, NATIVE

AVX2 = "x86-64-v3"
GOOD = b"int answer(void) { return 42; }\n"
BROKEN = b"int answer(void) { return 42 }\n"  # a missing semicolon
# Processes starting together (tensor-parallel ranks), and how long the wrapped compiler
# stalls, so that they all ask while the first one compiles.
RANKS = 4
COMPILE_STALL_S = 1.0
PREPROCESS_FLAG = "-dM"
RANK_SCRIPT = """
import logging, sys
from siesta import c_kernels
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
lib = c_kernels.build("probe", sys.stdin.buffer.read())
print("built" if lib is not None and lib.answer() == 42 else "none")
"""

x86_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86-64 target")


@pytest.fixture
def cc_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache, and CC a gcc wrapper that appends each call's arguments to the returned file."""
    gcc = c_kernels.compiler()
    if gcc is None or "wrapper" in gcc:
        pytest.skip("no C compiler")
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc-wrapper"
    stall = f'case "$*" in *{PREPROCESS_FLAG}*) ;; *) sleep "${{CC_STALL:-0}}" ;; esac'  # compilations only
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{stall}\nexec {gcc} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    c_kernels.predefined_macros.cache_clear()  # a new process's start: its wrapper path is new anyway
    yield log
    c_kernels.predefined_macros.cache_clear()


def _calls(log: Path) -> tuple[int, int]:
    """(compilations, macro queries) the wrapper saw."""
    lines = log.read_text().splitlines() if log.exists() else []
    queries = sum(PREPROCESS_FLAG in line for line in lines)
    return len(lines) - queries, queries


def _key_path(name: str, source: bytes, flags: tuple[str, ...]) -> Path:
    macros = c_kernels.predefined_macros(c_kernels.compiler(), flags)
    assert macros is not None
    return c_kernels.library_path(name, source, flags, macros)


def test_with_march_replaces_only_native() -> None:
    flags = c_kernels.with_march(CFLAGS, AVX2)
    assert f"-march={AVX2}" in flags and "-march=native" not in flags
    assert [f for f in flags if not f.startswith("-march")] == [f for f in CFLAGS if not f.startswith("-march")]
    assert c_kernels.with_march(CFLAGS, NATIVE) == CFLAGS
    with pytest.raises(ValueError, match="-march=native"):
        c_kernels.with_march(flags, "x86-64-v2")


@x86_only
def test_the_key_tells_native_avx512_from_avx2(cc_log: Path) -> None:
    """On an AVX-512 machine the native build and the AVX2 one are two libraries: a CPU of one
    model name without AVX-512 never loads the other's."""
    native_macros = c_kernels.predefined_macros(c_kernels.compiler(), CFLAGS)
    if b"__AVX512F__" not in native_macros:
        pytest.skip("this machine has no AVX-512")
    avx2_flags = c_kernels.with_march(CFLAGS, AVX2)
    assert b"__AVX512F__" not in c_kernels.predefined_macros(c_kernels.compiler(), avx2_flags)
    assert _key_path("probe", GOOD, CFLAGS) != _key_path("probe", GOOD, avx2_flags)
    assert c_kernels.runs_here(AVX2)


def test_the_key_holds_the_source_and_the_macros_are_asked_once(cc_log: Path) -> None:
    first = c_kernels.build("probe", GOOD)
    assert first is not None and first.answer() == 42
    other = GOOD + b"int other(void) { return 1; }\n"
    assert c_kernels.build("probe", other).other() == 1
    assert c_kernels.build("probe", GOOD).answer() == 42  # from the cache
    assert _calls(cc_log) == (2, 1)  # two sources compiled, the flags' macros asked for once
    assert _key_path("probe", GOOD, CFLAGS) != _key_path("probe", other, CFLAGS)


def test_a_failing_build_is_recorded_once_and_not_retried(cc_log: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=c_kernels.__name__):
        assert c_kernels.build("probe", BROKEN) is None
    marker = c_kernels.failure_marker(_key_path("probe", BROKEN, CFLAGS))
    assert "error" in marker.read_text()  # the compiler's own output, kept for whoever looks
    assert len(caplog.records) == 1 and str(marker) in caplog.records[0].getMessage()
    assert _calls(cc_log)[0] == 1

    caplog.clear()
    c_kernels.predefined_macros.cache_clear()  # as a later start would
    with caplog.at_level(logging.WARNING, logger=c_kernels.__name__):
        assert c_kernels.build("probe", BROKEN) is None
    assert _calls(cc_log)[0] == 1, "a recorded failure is not compiled again"
    (record,) = caplog.records  # one line, naming the file
    assert str(marker) in record.getMessage() and "\n" not in record.getMessage()


def test_without_a_compiler_nothing_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert c_kernels.build("probe", GOOD) is None
    assert not c_kernels.runs_here(NATIVE)


def _ranks(source: bytes) -> list[subprocess.CompletedProcess]:
    """RANKS processes building ``source`` at once, each answering "built" or "none"."""
    env = {**os.environ, "CC_STALL": str(COMPILE_STALL_S)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env) for _ in range(RANKS)]  # fmt: skip
    for p in procs:
        p.stdin.write(source)
        p.stdin.close()
    return [subprocess.CompletedProcess(p.args, p.wait(), p.stdout.read().decode(), p.stderr.read().decode())
            for p in procs]  # fmt: skip


def test_ranks_starting_together_compile_once(cc_log: Path) -> None:
    results = _ranks(GOOD)
    assert [r.stdout.strip() for r in results] == ["built"] * RANKS, [r.stderr for r in results]
    assert _calls(cc_log)[0] == 1


def test_ranks_starting_together_fail_once_with_one_warning(cc_log: Path) -> None:
    results = _ranks(BROKEN)
    assert [r.stdout.strip() for r in results] == ["none"] * RANKS
    assert _calls(cc_log)[0] == 1
    warnings = [line for r in results for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, warnings


def test_the_environment_can_build_every_native_kernel_for_another_target(tmp_path, monkeypatch):
    """SIESTA_CPU_MARCH=x86-64-v3: the library an AVX2-only machine would build, here."""
    import platform

    import pytest

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86-64 target")
    from siesta import c_kernels

    monkeypatch.setenv("SIESTA_CACHE_DIR", str(tmp_path))
    source = b"int answer(void) { return 42; }\n"
    native = c_kernels.build("probe", source)
    monkeypatch.setenv(c_kernels.MARCH_ENV, "x86-64-v3")
    avx2 = c_kernels.build("probe", source)
    assert native.answer() == avx2.answer() == 42
    assert len(list((tmp_path / c_kernels.KERNEL_SUBDIR).glob("probe-*.so"))) == 2  # two keys: two builds
