"""The router: OpenAI HTTP and gRPC fronts, request validation and
tokenization, and the pool of workers each request is sent to."""
