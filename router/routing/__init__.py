"""Where requests go: the request router and its policies over the
replicas' figures, the worker pools (a Serve handle, or workers in this
process) behind the WorkerPool protocol, failover, rebalancing and the
delta stream per worker."""
