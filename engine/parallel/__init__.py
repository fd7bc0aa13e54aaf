"""Splitting a model over several GPUs: which part of every weight each tensor-parallel (or
expert-parallel) rank holds (slicing.py: shard_plan, slice_weights); the loader reads just those
ranges with engine.weights.loader.load_weights_slice."""
