"""Workloads for A/B runs: the default arithmetic problems and their rule-based reward."""

from verl_ext.workload.arith import Problem, extract_final_number, make_problems, reward

__all__ = ["Problem", "extract_final_number", "make_problems", "reward"]
