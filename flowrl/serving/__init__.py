"""`flowrl serve-reward`: registered rewards served over HTTP to `remote` clients.

server.py is the HTTP front (protocol, limits, request ids) with the in-process backend; ray_serve.py scores on Ray
Serve replicas instead (the `serve` extra).
"""
