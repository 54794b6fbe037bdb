"""Every named seed equals the formula it replaced, on values worked out by hand (resumed runs compare bits)."""

from rlvr.platform.seeds import completion_seed, epoch_seed, group_seed, request_seed, round_seed, step_seed


def test_step_and_group_seeds():
    assert step_seed(0, 5) == 5
    assert step_seed(3, 7) == 3_000_016  # 3 * 1_000_003 + 7
    assert group_seed(2, 11) == 2_000_017  # 2 * 1_000_003 + 11


def test_round_seed():
    assert round_seed(3_000_016, 0) == 3_000_016
    assert round_seed(3_000_016, 2) == 2_003_000_030  # + 2 * 1_000_000_007


def test_epoch_seed():
    assert epoch_seed(0, 3) == 3
    assert epoch_seed(1234, 2) == 123_403_704  # 1234 * 100_003 + 2


def test_request_seed():
    assert request_seed(5, 3) == 5_023_922  # 5 * 1_000_033 + 3 * 7_919
    assert request_seed(3_000_000, 1) == 64_353_060  # 3_000_099_007_919 mod (2**31 - 1)
    assert 0 <= request_seed(10**12, 10**6) < 2**31 - 1


def test_completion_seed():
    assert completion_seed(1, 2, 3) == 1_009_005_048  # (1 * 1_000_003 + 2) * 1_009 + 3
    assert completion_seed(2**62, 0, 0) == 2**62  # (2**62 * 1_000_003 * 1_009) mod 2**63: the product is 2**62 * odd


def test_nearby_steps_and_rounds_never_share_a_seed():
    seeds = [round_seed(step_seed(seed, step), k) for seed in range(3) for step in range(200) for k in range(4)]
    assert len(set(seeds)) == len(seeds)
    requests = [request_seed(step_seed(0, step), i) for step in range(50) for i in range(16)]
    assert len(set(requests)) == len(requests)
