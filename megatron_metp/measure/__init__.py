"""Measurement: memory tracker, communication counter, analytic formulas, at-scale planner."""
