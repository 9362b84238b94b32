"""Speculative decoding (inference-optimization 8.5): drafts from the
trajectory itself, verified exactly by the target model in the batch.

    context_index.py  n-gram -> where it last continued, over one sequence (prompt lookup)
    suffix_store.py   the same over finished sequences of one cache_salt (the "suffix" source)
    step_cost.py      the measured cost of a step with r extra rows
    proposer.py       what to draft for each sequence this step, and how long (8.5.4)
    verify.py         the target's tokens for drafted rows: accept while they agree
"""
