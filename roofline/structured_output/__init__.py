"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

StructuredOutputsParams (roofline/sampling_params.py: what the user asked, no xgrammar) -> compiler.py
(xgrammar compiles off the engine loop, cached) -> matcher.py (per-request state in the engine) ->
bitmask.py (the step's mask, built in the engine, applied to logits in the worker) ; manager.py is what
EngineCore calls.
"""
