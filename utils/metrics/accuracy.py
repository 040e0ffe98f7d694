"""Top-1 accuracy as an `evaluate` metric module that loads offline.

`evaluate.load("accuracy")` fetches a script from the Hub (and pulls in scikit-learn);
loading this file by path gives the same `{"accuracy": ...}` with no network.
"""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to their reference label.",
            citation="",
            inputs_description="predictions: predicted class ids; references: true class ids.",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean())}
