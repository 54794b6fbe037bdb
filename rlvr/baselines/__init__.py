"""Baselines rlvr is measured against: PPO with a critic."""
