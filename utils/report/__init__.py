"""Out: what a training run reports: results.json, eval_results.json, throughput, memory, gradient norms, profiles."""
