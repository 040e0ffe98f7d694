"""The benchmark: the baselines' runtime, where each run's numbers were made, and the report."""
