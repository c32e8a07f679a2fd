"""Workloads for A/B runs: the default arithmetic problems and their rule-based reward."""

from verl_ext.workload.arith import Problem, encode_prompts, extract_final_number, make_problems, make_scorer, reward

__all__ = ["Problem", "encode_prompts", "extract_final_number", "make_problems", "make_scorer", "reward"]
