"""The inference engine: checkpoints in, streamed tokens out."""
