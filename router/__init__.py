"""The router, in three rooms: fronts/ (the OpenAI HTTP app, the gRPC
servicer, validation and tokenization, the Serve ingress), routing/ (the
request router and its policies, the worker pools, failover, rebalancing,
the delta stream) and observability/ (metrics, tracing, the status page).
Imports point down that list: the fronts use the other two, routing uses
observability's tracing, and observability reads only routing's replica
registry (a worker that leaves takes its series). options.py is the
replica's settings, which the cluster fills."""
