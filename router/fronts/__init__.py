"""Where requests come in: the OpenAI HTTP app, the gRPC servicer, the
prompt and body checks, the Frontend they share, and the Serve ingress
that wires a router replica together."""
