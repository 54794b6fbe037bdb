"""Verifiers that survive hostile or pathological model output: a process-pool math checker and a
namespaced code sandbox. This package imports neither torch nor the rest of rlvr, so its worker
processes start light."""
