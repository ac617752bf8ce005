"""`auto` host tiers size from the memory the job may take: the host's MemAvailable, lowered to what is
left under the memory limit of the process's cgroup (v2, else v1), read from a fake root here."""

import pytest

from miles_plugins.host.memory import available_host_memory

GIB = 1 << 30


def _root(tmp_path, files: dict[str, str]):
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return str(tmp_path)


def _meminfo(available_gib: int) -> str:
    return f"MemTotal:       {512 * GIB // 1024} kB\nMemAvailable:   {available_gib * GIB // 1024} kB\n"


def test_a_v2_limit_below_the_host_memory_wins(tmp_path):
    root = _root(tmp_path, {"proc/meminfo": _meminfo(400), "proc/self/cgroup": "0::/slurm/job_7/step_0\n",
                            "sys/fs/cgroup/slurm/job_7/step_0/memory.max": f"{16 * GIB}\n",
                            "sys/fs/cgroup/slurm/job_7/step_0/memory.current": f"{4 * GIB}\n"})
    assert available_host_memory(root) == 12 * GIB


def test_a_limit_on_a_parent_cgroup_counts_too(tmp_path):
    root = _root(tmp_path, {"proc/meminfo": _meminfo(400), "proc/self/cgroup": "0::/job/step\n",
                            "sys/fs/cgroup/job/step/memory.max": "max\n",
                            "sys/fs/cgroup/job/step/memory.current": f"{1 * GIB}\n",
                            "sys/fs/cgroup/job/memory.max": f"{8 * GIB}\n",
                            "sys/fs/cgroup/job/memory.current": f"{3 * GIB}\n"})
    assert available_host_memory(root) == 5 * GIB


def test_max_is_no_limit_and_the_host_memory_stands(tmp_path):
    root = _root(tmp_path, {"proc/meminfo": _meminfo(40), "proc/self/cgroup": "0::/\n",
                            "sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": f"{GIB}\n"})
    assert available_host_memory(root) == 40 * GIB


def test_v1_is_read_where_v2_has_no_memory_controller(tmp_path):
    root = _root(tmp_path, {"proc/meminfo": _meminfo(400),
                            "proc/self/cgroup": "12:cpu,cpuacct:/job\n4:memory:/job\n0::/job\n",
                            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": f"{32 * GIB}\n",
                            "sys/fs/cgroup/memory/job/memory.usage_in_bytes": f"{2 * GIB}\n"})
    assert available_host_memory(root) == 30 * GIB


def test_a_limit_above_the_host_memory_leaves_the_host_reading(tmp_path):
    root = _root(tmp_path, {"proc/meminfo": _meminfo(10), "proc/self/cgroup": "4:memory:/\n",
                            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
                            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB}\n"})
    assert available_host_memory(root) == 10 * GIB


@pytest.mark.parametrize("cgroup", ["0::/../../etc\n", "0::relative\n"])
def test_a_cgroup_path_that_is_no_kernels_is_ignored(tmp_path, cgroup):
    root = _root(tmp_path, {"proc/meminfo": _meminfo(10), "proc/self/cgroup": cgroup,
                            "etc/memory.max": f"{GIB}\n", "etc/memory.current": "0\n",
                            "sys/fs/cgroup/relative/memory.max": f"{GIB}\n",
                            "sys/fs/cgroup/relative/memory.current": "0\n"})
    assert available_host_memory(root) == 10 * GIB


def test_nothing_readable_is_unknown_and_a_limit_alone_is_enough(tmp_path):
    assert available_host_memory(str(tmp_path)) is None
    root = _root(tmp_path, {"proc/self/cgroup": "0::/c\n", "sys/fs/cgroup/c/memory.max": f"{2 * GIB}\n",
                            "sys/fs/cgroup/c/memory.current": f"{GIB}\n"})
    assert available_host_memory(root) == GIB


def test_a_huge_file_is_read_only_in_part(tmp_path):
    root = _root(tmp_path, {"proc/meminfo": "X: 1 kB\n" * 100_000 + "MemAvailable: 1 kB\n"})
    assert available_host_memory(root) is None  # past the bound: not read


V2_LIMIT = ("0::/c\n", "sys/fs/cgroup/c", "memory.max", "memory.current")
V1_LIMIT = ("4:memory:/job\n", "sys/fs/cgroup/memory/job", "memory.limit_in_bytes", "memory.usage_in_bytes")


def _limited(tmp_path, cgroup, limit_gib: int, usage_gib: int, stat: str) -> str:
    line, directory, limit_file, usage_file = cgroup
    return _root(tmp_path, {"proc/meminfo": _meminfo(400), "proc/self/cgroup": line,
                            f"{directory}/{limit_file}": f"{limit_gib * GIB}\n",
                            f"{directory}/{usage_file}": f"{usage_gib * GIB}\n", f"{directory}/memory.stat": stat})


@pytest.mark.parametrize("cgroup, stat, left_gib", [
    # a model folder just written sits in the cgroup's page cache: the kernel reclaims its clean part under
    # the limit, so it is left; dirty pages and pages under writeback are not
    (V2_LIMIT, f"anon {3 * GIB}\nactive_file {4 * GIB}\ninactive_file {5 * GIB}\nfile_dirty {GIB}\n"
               f"file_writeback {GIB}\nshmem 0\n", 20 - 12 + 7),
    # v1: its hierarchical total_ counters, not the cgroup's own
    (V1_LIMIT, f"cache {9 * GIB}\nactive_file {GIB}\ntotal_active_file {2 * GIB}\ntotal_inactive_file {6 * GIB}\n"
               f"total_dirty {GIB}\ntotal_writeback 0\n", 20 - 12 + 7),
    # more cache than usage, a value that is no number: never more than the limit itself
    (V2_LIMIT, f"active_file {64 * GIB}\ninactive_file x\nfile_dirty -1\n", 20),
], ids=["v2", "v1", "nonsense"])
def test_clean_page_cache_under_a_limit_counts_as_left(tmp_path, cgroup, stat, left_gib):
    assert available_host_memory(_limited(tmp_path, cgroup, 20, 12, stat)) == left_gib * GIB
