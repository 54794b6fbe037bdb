"""The compiled-language judge the compiled tests share: one per test module (its compile cache, its slots)."""

import pytest

from rlvr.verifiers.compiled import Settings
from rlvr.verifiers.compiled_judge import CompiledJudge, Program
from rlvr.verifiers.sandbox import SandboxUnavailable


@pytest.fixture(scope="module")
def judge():
    box = CompiledJudge(Settings(cpu_s=1.0, compile_cpu_s=8.0))  # <bits/stdc++.h> at -O2: 4 s of CPU on a busy machine
    try:
        box.judge([Program("c", "int main(void) { return 0; }\n", cases=[("", "")])])
    except SandboxUnavailable as err:
        pytest.skip(f"no isolation on this machine: {err}")
    yield box
    box.close()
