"""Prompts, tasks, scoring, real pairs, HumanEval and the sandbox that runs model-written code."""
