"""Driving an LLMEngine in tests."""


def run_requests(engine, requests):
    """Queue (prompt, params) pairs, or (prompt, params, lora) triples,
    together and step until all finish; the final RequestOutputs in the
    order given."""
    ids = [engine.add_request(*r[:2], **({"lora": r[2]} if len(r) > 2 else {})) for r in requests]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]
