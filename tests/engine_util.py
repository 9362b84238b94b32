"""Driving an LLMEngine in tests."""


def run_requests(engine, requests):
    """Queue (prompt, params) pairs together and step until all finish;
    the final RequestOutputs in the order given."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]
