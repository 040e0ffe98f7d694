"""Top-1 and top-k accuracy as an `evaluate` metric module that loads offline.

predictions: for each sample, the k class ids with the highest scores, best first
(`logits.topk(k).indices`); references: the true class ids. Load it with
`utils.metrics.load_metric("topk_accuracy")`.
"""

import datasets
import evaluate
import numpy as np


class TopkAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of samples whose true class is the top prediction (accuracy) "
                        "or among the k top predictions (top_k_accuracy, k = predictions per sample).",
            citation="",
            inputs_description="predictions: k class ids per sample, best first; references: true class ids.",
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("int64")), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        hits = predictions == references[:, None]
        return {
            "accuracy": float(hits[:, 0].mean()),
            "top_k_accuracy": float(hits.any(axis=1).mean()),
            "k": predictions.shape[1],
        }
