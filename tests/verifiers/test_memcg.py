"""Where the sandbox's per-slot memory cgroups go, read from /proc/self/{cgroup,mountinfo} texts."""

import os

from rlvr.verifiers.memcg import SlotCgroups, find_parent, remove_stale

V1_MOUNTS = (
    "30 25 0:27 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n"
    "35 25 0:32 / /sys/fs/cgroup/memory rw,relatime shared:14 - cgroup cgroup rw,memory\n"
    "36 25 0:33 / /sys/fs/cgroup/pids rw,relatime shared:15 - cgroup cgroup rw,pids\n"
)
HYBRID_CGROUP = "4:memory:/jobs/42\n8:pids:/\n0::/\n"


def test_v1_memory_hierarchy_when_v2_lacks_the_memory_controller(tmp_path):
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("hugetlb\n")  # what this project's machines show
    mounts = V1_MOUNTS.replace("/sys/fs/cgroup/unified", str(unified))
    assert find_parent(HYBRID_CGROUP, mounts) == ("v1", "/sys/fs/cgroup/memory/jobs/42")


def test_v2_when_it_has_the_memory_controller(tmp_path):
    own = tmp_path / "user.slice" / "run.scope"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpu io memory pids\n")
    mounts = f"30 25 0:27 / {tmp_path} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    assert find_parent("0::/user.slice/run.scope\n", mounts) == ("v2", str(own))


def test_a_mount_of_a_subtree_and_no_hierarchy():
    mounts = "35 25 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
    assert find_parent("4:memory:/docker/abc/inner\n", mounts) == ("v1", "/sys/fs/cgroup/memory/inner")
    assert find_parent("4:memory:/elsewhere\n", mounts) is None  # outside what is mounted
    assert find_parent("0::/\n", "") is None


def test_a_parent_that_is_not_a_cgroup_means_no_memory_cgroup(tmp_path):
    slots = SlotCgroups(2, 64, parent=str(tmp_path))
    assert slots.paths is None and "neither a cgroup v2 directory" in slots.reason


def test_slot_cgroups_of_a_killed_trainer_are_removed(tmp_path):
    gone, alive = tmp_path / "rlvr-sandbox-999999999-0-slot0", tmp_path / f"rlvr-sandbox-{os.getpid()}-0-slot0"
    gone.mkdir()
    alive.mkdir()
    remove_stale(tmp_path)
    assert not gone.exists() and alive.exists()
