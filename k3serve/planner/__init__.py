"""Capacity planner: would a model fit, on what, for how many users, launched how (`k3serve plan`)."""
