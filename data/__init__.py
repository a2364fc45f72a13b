"""Mid-training data: inputs (files, repositories, JSONL, Parquet) -> cleaning (dedup, filters, redaction) ->
shaping (FIM, repository documents) -> Megatron indexed datasets, on datatrove; see `data.pipeline`."""
