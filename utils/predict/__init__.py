"""Prediction and export (scripts/predict.py): a finished run read back, its model rebuilt, the rows, ONNX."""
