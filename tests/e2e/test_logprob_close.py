"""The logprob-close rule as benchmarks/smollm2_gpu.py applies it to the GPU comparisons: equal tokens
up to the first difference; there, each side's token is in the other's top-5 at that step."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "gpu_smollm2", Path(__file__).resolve().parents[2] / "benchmarks" / "smollm2_gpu.py")
gpu_smollm2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_smollm2)


def test_a_near_tie_is_close_and_a_token_outside_the_top5_is_not():
    tops = [{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}, {11, 12, 13, 14, 15}]
    same = ([[1, 6, 11]], [tops])
    near = ([[1, 7, 12]], [tops])  # differs at step 1, inside the other's top-5 there
    far = ([[1, 99, 11]], [[{1, 2, 3, 4, 5}, {99, 6, 7, 8, 9}, tops[2]]])  # 99 is not in the other's top-5
    tally = {"n": 1, "tokens": 3}
    assert gpu_smollm2.compare(same, same) == {"identical": 1, "close": 1, "first_diffs": [], "agreed": 3, **tally}
    assert gpu_smollm2.compare(same, near) == {"identical": 0, "close": 1, "first_diffs": [1], "agreed": 1, **tally}
    assert gpu_smollm2.compare(same, far) == {"identical": 0, "close": 0, "first_diffs": [1], "agreed": 1, **tally}
    shorter = ([[1, 6]], [tops[:2]])  # stopped (EOS) one token earlier: agrees on both of its tokens
    assert gpu_smollm2.compare(shorter, same)["agreed"] == 2
