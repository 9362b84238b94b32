"""Past one machine (issue 28): routing requests over engine replicas.

    directory.py   the prefix directory: which replica holds which chained block hash, on which tier
    router.py      the routing policies (kv: 7's affinity-versus-load objective; round-robin,
                   least-loaded, char-prefix as baselines), session affinity and health

Not built yet: the replicas on Ray and the front end, the engine's KV
events, the simulator's N replicas behind these routers.
"""
