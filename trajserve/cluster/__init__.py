"""Past one machine (issue 28): routing requests over engine replicas.

    directory.py   the prefix directory: which replica holds which chained block hash, on which tier
                   (fed by the radix caches' KV events: kv/radix_cache.py on_event)
    router.py      the routing policies (kv: figure 7's affinity-versus-load objective; round-robin,
                   least-loaded, char-prefix as baselines), session affinity and health

The simulator runs N replicas behind these routers (sim/fleet.py,
`simulate --replicas N`). Not built yet: the replicas on Ray and their
OpenAI-compatible front end, lower-tier KV events, failover.
"""
