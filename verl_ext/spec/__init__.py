"""Speculative drafting (suffix-tree drafters, draft-length policies).

Planned: the native suffix-tree index and model-free drafting inside vLLM. Nothing here is
registered or selectable yet.
"""
