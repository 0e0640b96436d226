"""The ``inference`` job kind: streaming batch inference (CPU tokenization on Lambda, GPU on AWS Batch)."""
