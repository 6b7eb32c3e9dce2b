"""The memory limit read from cgroup files (v1 and v2, set on an ancestor) and MemTotal."""

from __future__ import annotations

from pathlib import Path

from rlvr_lightning.runtime import memory


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limits_on_the_path_to_the_root(tmp_path):
    _write(tmp_path / "job" / "memory.max", "4294967296\n")  # an ancestor's limit: 4 GiB
    _write(tmp_path / "job" / "step" / "memory.max", "max\n")  # none on the process's own
    _write(tmp_path / "proc_cgroup", "0::/job/step\n")
    found = memory.cgroup_limits(tmp_path / "proc_cgroup", root=tmp_path)
    assert found == [(4 * 2**30, tmp_path / "job" / "memory.max")]


def test_cgroup_v1_unlimited_is_no_limit(tmp_path):
    _write(tmp_path / "memory" / "a" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(tmp_path / "memory" / "memory.limit_in_bytes", "1073741824\n")
    _write(tmp_path / "proc_cgroup", "4:memory:/a\n3:cpu:/a\n")
    found = memory.cgroup_limits(tmp_path / "proc_cgroup", root=tmp_path)
    assert found == [(2**30, tmp_path / "memory" / "memory.limit_in_bytes")]


def test_mem_total_and_resident(tmp_path):
    _write(tmp_path / "meminfo", "MemTotal:       16384 kB\nMemFree: 1 kB\n")
    assert memory.mem_total(tmp_path / "meminfo") == 16384 * 1024
    assert memory.resident_bytes() > 10 * 2**20  # this Python process
