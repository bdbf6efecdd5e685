"""``ferrule serve``: a Tinker-compatible training service in front of the train engine.

The real ``tinker`` SDK (0.38.0) drives it unmodified: point ``tinker.ServiceClient`` at
``http://HOST:PORT`` with an API key the server knows. See docs/serve.md.
"""
