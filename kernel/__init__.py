"""localm's kernel: routing, scopes, config, jobs and the engine hook spec.

Plugins never import this package; they import :mod:`localm.sdk`.
"""

__version__ = "0.1.0"
