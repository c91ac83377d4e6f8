"""Constrained decoding: a request's StructuredOutputsParams compiled into a
grammar, whose token mask the sampler applies every step."""
