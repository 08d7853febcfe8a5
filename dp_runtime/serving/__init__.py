"""Requests, the scheduler, sampling, the paged KV cache and the ForwardBatch a step runs."""
