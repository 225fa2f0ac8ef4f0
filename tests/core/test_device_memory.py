"""The CPU KV cache: an anonymous mapping that commits memory only where KV is written, and
gives it back on sleep. Measured as the process's resident bytes (Linux /proc)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from siesta.attention.base import KVCache
from siesta.core.device_memory import SleepableMemory
from siesta.core.host_backup import CAPTURE_LOCK, HostBackup
from siesta.device_activity import ActivityClock

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")

MiB = 1 << 20
KiB = 1 << 10


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_large_cpu_cache_costs_only_what_it_holds_and_sleep_gives_it_back() -> None:
    before = _resident_bytes()
    kv = KVCache.allocate(8192, 4, 16, 8, 64, torch.float32, torch.device("cpu"))  # 2 GiB
    assert kv.tensor.numel() * 4 == 2048 * MiB
    assert _resident_bytes() - before < 64 * MiB, "allocating must not commit the pages"
    assert torch.count_nonzero(kv.tensor[:8]) == 0  # unwritten slots read as zeros
    kv.tensor[:2048].fill_(1.0)  # a quarter of the blocks hold KV
    written = _resident_bytes() - before
    assert 480 * MiB < written < 640 * MiB
    memory = SleepableMemory([torch.zeros(4)], kv, torch.device("cpu"))
    report = memory.release_kv_cache()
    assert report.bytes == 2048 * MiB
    assert _resident_bytes() - before < 64 * MiB, "sleep must return the written pages"
    assert torch.count_nonzero(kv.tensor) == 0
    memory.restore_kv_cache()
    kv.tensor[3].fill_(2.0)  # usable again, at the same address
    assert kv.tensor[3].sum() == 2.0 * kv.tensor[3].numel()


# -- the weights' host backup ---------------------------------------------------------------------


class FakePinner:
    """Records the ranges pinned and unpinned, and whether graph capture's lock was held."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[int] = []
        self.lock_held: list[bool] = []
        self.fail_at, self.gate = fail_at, gate

    def pin(self, address: int, nbytes: int) -> None:
        if self.gate is not None:
            self.gate.wait()
        self.lock_held.append(CAPTURE_LOCK.locked())
        if self.fail_at is not None and len(self.pinned) == self.fail_at:
            raise RuntimeError("cudaHostRegister failed")
        self.pinned.append((address, nbytes))

    def unpin(self, address: int) -> None:
        self.unpinned.append(address)


def _weights(sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def test_the_backup_is_pinned_in_chunks_in_the_background_each_under_the_capture_lock() -> None:
    fake = FakePinner()
    backup = HostBackup(10 * KiB + 5, (fake.pin, fake.unpin), background=True, chunk_bytes=4 * KiB)
    assert backup.wait() >= 0.0 and backup.ready
    # Three registrations that tile the buffer exactly, each under the lock capture holds.
    assert [n for _, n in fake.pinned] == [4 * KiB, 4 * KiB, 2 * KiB + 5]
    assert [a - fake.pinned[0][0] for a, _ in fake.pinned] == [0, 4 * KiB, 8 * KiB]
    assert fake.lock_held == [True, True, True]
    backup.close()
    assert fake.unpinned == [a for a, _ in fake.pinned]


def test_a_capture_holding_the_lock_holds_the_pinning_back() -> None:
    fake = FakePinner()
    with CAPTURE_LOCK:  # as ModelRunner.recapture_graphs does while it captures
        backup = HostBackup(8 * KiB, (fake.pin, fake.unpin), background=True, chunk_bytes=4 * KiB)
        time.sleep(0.05)
        assert fake.pinned == [] and not backup.ready
    backup.wait()
    assert len(fake.pinned) == 2


def test_background_pinning_waits_until_no_step_has_run_for_a_while() -> None:
    """Each pin holds the driver's lock that a step's launches need (run 50: batch-1 decode
    5.8 -> 8.3 ms a step while 16 GB were pinned), so chunks go in only between busy spells."""
    fake, steps, quiet_s = FakePinner(), ActivityClock(), 0.2
    steps.touch()
    backup = HostBackup(8 * KiB, (fake.pin, fake.unpin), background=True, chunk_bytes=4 * KiB, steps=steps,
                        quiet_s=quiet_s)  # fmt: skip
    for _ in range(10):  # steps every 30 ms: never quiet for 0.2 s
        time.sleep(0.03)
        steps.touch()
    assert fake.pinned == [] and not backup.ready
    deadline = time.monotonic() + 5
    while not backup.ready and time.monotonic() < deadline:  # quiet now: it goes on by itself
        time.sleep(0.01)
    assert len(fake.pinned) == 2 and backup.ready
    backup.close()


def test_a_sleep_that_needs_the_backup_pins_it_at_once_however_busy_the_device() -> None:
    fake, steps = FakePinner(), ActivityClock()
    steps.touch()
    backup = HostBackup(8 * KiB, (fake.pin, fake.unpin), background=True, chunk_bytes=4 * KiB, steps=steps,
                        quiet_s=3600.0)  # fmt: skip
    t0 = time.monotonic()
    backup.wait()
    assert len(fake.pinned) == 2 and time.monotonic() - t0 < 5
    backup.close()


def test_a_step_and_a_weight_push_each_mark_the_device_busy(monkeypatch) -> None:
    from siesta import LLM, SamplingParams
    from siesta.core import model_runner
    from siesta.weight_transfer import updater

    llm = LLM("random:tiny-llama", device="cpu", max_model_len=256)
    for module in (model_runner, updater):
        clock = ActivityClock()
        monkeypatch.setattr(module, "DEVICE_WORK", clock)
        assert clock.quiet_in(60.0) == 0.0
        if module is model_runner:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
        else:
            embed = llm.engine.runner.model.model.embed_tokens.weight
            llm.update_weights({"model.embed_tokens.weight": embed.detach().clone()})
        assert clock.quiet_in(60.0) > 59.0, module.__name__


def test_copies_are_cut_where_chunks_meet_and_come_back_exact() -> None:
    backup = HostBackup(10 * KiB, None, background=False, chunk_bytes=4 * KiB)
    assert backup._segments(3 * KiB, 6 * KiB) == [(3 * KiB, KiB), (4 * KiB, 4 * KiB), (8 * KiB, KiB)]
    backup.wait()
    data = torch.randint(0, 256, (6 * KiB,), dtype=torch.uint8)
    backup.store(data, 3 * KiB)
    out = torch.zeros_like(data)
    backup.load(out, 3 * KiB)
    assert torch.equal(out, data)
    with pytest.raises(ValueError, match="does not fit"):
        backup.store(data, 5 * KiB)


def test_a_failed_background_pin_falls_back_and_unpins_what_it_had_pinned() -> None:
    fake = FakePinner(fail_at=1)
    backup = HostBackup(8 * KiB, (fake.pin, fake.unpin), background=True, chunk_bytes=4 * KiB)
    with pytest.raises(RuntimeError, match="not ready"):
        backup.store(torch.zeros(4, dtype=torch.uint8))
    # Let the thread reach its failing pin first: were _pin cleared before that, the second
    # chunk would go unpinned without an error, and nothing would fall back.
    backup.settle()
    fake_pin = fake.pinned[:]
    # The fallback allocates the way torch pins (pin_memory), which this CPU-only test cannot:
    # what matters is that the half-registered memory was unregistered before it was freed.
    backup._pin = None
    backup.wait()
    assert fake.unpinned == [a for a, _ in fake_pin] and backup.ready


def test_closing_a_backup_mid_pinning_stops_at_the_next_chunk_and_unpins_what_it_pinned() -> None:
    fake = FakePinner(gate=threading.Event())
    backup = HostBackup(16 * KiB, (fake.pin, fake.unpin), background=True, chunk_bytes=4 * KiB,
                        steps=ActivityClock())  # a device that ran no step: pinning starts at once
    threading.Timer(0.05, fake.gate.set).start()  # the first pin is under way when close() comes
    time.sleep(0.01)
    backup.close()
    assert len(fake.pinned) == 1, "the thread went on past the chunk it was pinning"
    assert fake.unpinned == [fake.pinned[0][0]]
    with pytest.raises(RuntimeError, match="closed"):
        backup.wait()


def test_a_backup_dropped_while_it_pins_unpins_everything_before_its_memory_is_freed() -> None:
    """Dropped by its engine mid-pinning, the backup lives on in its thread, whose end is then
    the last reference: the finalizer runs in that thread. It once tried to join itself there,
    failed quietly, and freed memory still registered with CUDA (the next engine's allocations
    on the H200 then failed with 'resource already mapped')."""
    fake = FakePinner(gate=threading.Event())
    backup = HostBackup(16 * KiB, (fake.pin, fake.unpin), background=True, chunk_bytes=4 * KiB,
                        steps=ActivityClock())  # a device that ran no step: pinning starts at once
    thread, finalized = backup._thread, threading.Event()
    weakref.finalize(backup, finalized.set)
    del backup
    fake.gate.set()
    thread.join(timeout=10)
    assert finalized.wait(timeout=10), "the backup outlived its thread"
    assert len(fake.pinned) == 4
    assert sorted(fake.unpinned) == sorted(a for a, _ in fake.pinned)


# Pins 40 chunks at 50 ms each, and exits while the thread is inside a pin.
_EXITING_WHILE_PINNING = """
import sys, time
from siesta.core.host_backup import HostBackup

def pin(address, nbytes):
    print("enter", flush=True)
    time.sleep(0.05)
    print("leave", flush=True)

backup = HostBackup(40 * 4096, (pin, lambda a: None), background=True, chunk_bytes=4096)
time.sleep(0.12)
"""


def test_a_process_exiting_while_its_backup_pins_waits_for_the_chunk_in_hand_only() -> None:
    # Killed inside a pin, the thread would be inside the CUDA runtime as the process tears it
    # down (which aborted such processes on the H200); stopped at exit, it ends between chunks.
    done = subprocess.run([sys.executable, "-c", _EXITING_WHILE_PINNING], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines and lines[-1] == "leave", lines
    assert 1 <= lines.count("leave") < 40, "the exit waited for the whole backup"


@pytest.mark.parametrize("background", [True, False])
def test_sleep_restores_the_weights_bit_for_bit_from_a_backup_made_before_or_at_the_first_sleep(background) -> None:
    weights = _weights([1000, 37, 4096])
    expected = [w.clone() for w in weights]
    kv = KVCache.allocate(4, 2, 16, 2, 8, torch.float32, torch.device("cpu"))
    memory = SleepableMemory(weights, kv, torch.device("cpu"), background_backup=background)
    assert memory.backup.nbytes == sum(w.numel() * 4 for w in weights)
    if background:
        memory.backup.settle()
        assert memory.backup.ready  # made before anyone slept
    for _ in range(2):  # the second sleep reuses the same memory
        report = memory.release_weights(backup=True)
        assert report.bytes == memory.weight_bytes and all(w.untyped_storage().nbytes() == 0 for w in weights)
        memory.restore_weights()
        assert all(torch.equal(w, e) for w, e in zip(weights, expected))
        weights[0].add_(1.0)  # new weights between sleeps are what the next backup holds
        expected[0].add_(1.0)


def test_the_backup_mode_is_validated_and_auto_is_background_on_cuda_only() -> None:
    from siesta.config import ConfigError, EngineConfig

    assert not EngineConfig(device="cpu").background_weight_backup()
    assert EngineConfig(device="cuda").background_weight_backup()
    assert not EngineConfig(device="cuda", enable_sleep_mode=False).background_weight_backup()
    assert EngineConfig(device="cpu", weight_backup="background").background_weight_backup()
    assert not EngineConfig(device="cuda", weight_backup="first_sleep").background_weight_backup()
    with pytest.raises(ConfigError, match="weight_backup must be one of"):
        EngineConfig(device="cpu", weight_backup="eager").validate(128)
    # LLM(weight_backup=...) and --weight-backup reach it.
    from siesta.config import EngineFlags

    assert EngineFlags(device="cuda", weight_backup="first_sleep").config().weight_backup == "first_sleep"
