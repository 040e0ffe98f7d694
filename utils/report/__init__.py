"""Out: what a run reports (results.json, throughput, memory), profiles, benchmarks, predictions and exports."""
