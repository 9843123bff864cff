"""The KV cache's tiers: the device block pool (`blocks`), and the host tier (`host_tier`, over
`host_pool` and `copier`). Nothing here imports the scheduler, the sessions or the core: they ask
these classes, never the other way round."""
