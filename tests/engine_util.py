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


def gone_when_dropped(build, use) -> list[bool]:
    """With the garbage collector off: build() an engine, use(engine), close
    it and drop it; whether the engine, its model and its first pool tensor
    are gone then (a reference cycle would keep them until a collection)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        engine = build()
        use(engine)
        engine.close()
        refs = [weakref.ref(x) for x in (engine, engine.model, engine.runner.kv_caches[0][0])]
        del engine
        return [r() is None for r in refs]
    finally:
        gc.enable()
