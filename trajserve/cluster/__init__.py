"""Past one machine: engine replicas on Ray behind one routing front end.

    directory.py   the prefix directory: which replica holds which chained block hash, on which tier
                   (fed by the replicas' KV events: kv/radix_cache.py and kv/lower_tiers.py on_event)
    router.py      the routing policies (kv: figure 7's affinity-versus-load objective; round-robin,
                   least-loaded, char-prefix as baselines), session affinity and health
    replica.py     one engine and its whole server app in a Ray actor; its KV events and load as reports
    asgi.py        a request through an ASGI app in-process, its answer streamed out
    route_key.py   what a request is routed by: its rendered prompt, session, stored response
    replicas.py    the front end's view of the replicas: health, reports, restarts, streaming calls
    frontend.py    the OpenAI-compatible front end: routing, forwarding, failover, /metrics
    launch.py      `serve --replicas N [--ray-address ADDR]`: Ray, the actors, the front end

The simulator runs N replicas behind the same routers (sim/fleet.py, `simulate --replicas N`).
"""
