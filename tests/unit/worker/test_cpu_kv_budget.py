"""The CPU KV-cache budget: the flag, then VLLM_CPU_KVCACHE_SPACE, then half the memory this
process can still take (host or cgroup) capped at what max_num_seqs x max_model_len can use."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker_svc.runner.cpu_kv_budget import GIB, EngineShape, available_memory, cpu_kv_budget

MIB = 1 << 20
BLOCK_BYTES = 64 * 1024  # e.g. 2 layers x (K, V) x 16 tokens x 8 heads x 64 dims x 4 bytes
SMALL = EngineShape(max_num_seqs=4, max_model_len=100, block_size=16)  # 4 x 7 + 1 = 29 blocks
HUGE = EngineShape(max_num_seqs=256, max_model_len=131072, block_size=16)


def fake_root(
    tmp_path: Path, available_kib: int, cgroup: tuple[str, str, str] | None = None
) -> Path:
    """/proc/meminfo with MemAvailable; `cgroup` = (version, limit, usage) with 30 MiB of
    inactive file pages in memory.stat."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(
        f"MemTotal:       99999999 kB\nMemFree:        1 kB\nMemAvailable:   {available_kib} kB\n"
    )
    if cgroup is not None:
        version, limit, usage = cgroup
        if version == "v2":
            folder, names, inactive = (
                tmp_path / "sys/fs/cgroup",
                ("max", "current"),
                "inactive_file",
            )
        else:
            folder = tmp_path / "sys/fs/cgroup/memory"
            names, inactive = ("limit_in_bytes", "usage_in_bytes"), "total_inactive_file"
        folder.mkdir(parents=True)
        (folder / f"memory.{names[0]}").write_text(limit + "\n")
        (folder / f"memory.{names[1]}").write_text(usage + "\n")
        (folder / "memory.stat").write_text(f"anon 1\n{inactive} {30 * MIB}\nactive_file 7\n")
    return tmp_path


def test_the_flag_wins_over_everything(tmp_path: Path) -> None:
    root = fake_root(tmp_path, 1024)
    env = {"VLLM_CPU_KVCACHE_SPACE": "8"}
    budget = cpu_kv_budget(5 * MIB, BLOCK_BYTES, SMALL, env, root)
    assert (budget.num_bytes, budget.reason) == (5 * MIB, "--kv-cache-memory-bytes")


def test_vllm_cpu_kvcache_space_is_taken_as_given(tmp_path: Path) -> None:
    root = fake_root(tmp_path, 1024)
    budget = cpu_kv_budget(0, BLOCK_BYTES, SMALL, {"VLLM_CPU_KVCACHE_SPACE": "1.5"}, root)
    assert budget.num_bytes == int(1.5 * GIB)  # not capped: the operator asked for it
    assert "VLLM_CPU_KVCACHE_SPACE" in budget.reason


@pytest.mark.parametrize("value", ["0", "-2", "lots"])
def test_a_bad_vllm_cpu_kvcache_space_is_refused(tmp_path: Path, value: str) -> None:
    root = fake_root(tmp_path, 1024)
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        cpu_kv_budget(0, BLOCK_BYTES, SMALL, {"VLLM_CPU_KVCACHE_SPACE": value}, root)


def test_capped_by_what_the_engine_can_use(tmp_path: Path) -> None:
    root = fake_root(tmp_path, 16 * 1024 * 1024)  # 16 GiB available
    budget = cpu_kv_budget(0, BLOCK_BYTES, SMALL, {}, root)
    assert budget.num_bytes == SMALL.num_blocks_usable() * BLOCK_BYTES == 29 * BLOCK_BYTES
    assert "max_num_seqs 4 x max_model_len 100" in budget.reason


def test_half_the_available_memory_when_the_engine_could_use_more(tmp_path: Path) -> None:
    root = fake_root(tmp_path, 8 * 1024 * 1024)  # 8 GiB
    budget = cpu_kv_budget(0, BLOCK_BYTES, HUGE, {}, root)
    assert budget.num_bytes == 4 * GIB
    assert budget.reason.startswith("0.5 x 8.00 GiB available (MemAvailable)")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroup_limit_below_the_host_memory_bounds_it(tmp_path: Path, version: str) -> None:
    # 2 GiB limit, 1 GiB + 30 MiB used of which 30 MiB reclaimable page cache: 1 GiB left.
    cgroup = (version, str(2 * GIB), str(GIB + 30 * MIB))
    root = fake_root(tmp_path, 64 * 1024 * 1024, cgroup)
    assert available_memory(root) == (GIB, "cgroup memory limit")
    assert cpu_kv_budget(0, BLOCK_BYTES, HUGE, {}, root).num_bytes == GIB // 2


@pytest.mark.parametrize(
    "cgroup", [("v2", "max", str(GIB)), ("v1", str(9223372036854771712), str(GIB))]
)
def test_an_unlimited_cgroup_leaves_the_host_figure(
    tmp_path: Path, cgroup: tuple[str, str, str]
) -> None:
    root = fake_root(tmp_path, 3 * 1024 * 1024, cgroup)
    assert available_memory(root) == (3 * GIB, "MemAvailable")


def test_this_machine_reports_some_memory() -> None:
    free, where = available_memory()
    assert free > 0 and where in ("MemAvailable", "cgroup memory limit")
