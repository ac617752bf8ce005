"""Rollout routing replay (R3) for MoE models: the routes' data path.

- :mod:`miles.routing.routes`: :class:`Routes`, one sample's chosen experts per MoE layer and token in a
  compact dtype (bytes per token there), pickled as bytes, JSON as base64, checked on the way in;
  :class:`RouteShape`, a model's (experts, top-k, MoE layers).
- :mod:`miles.routing.routers`: finding a transformers model's routers and each family's gate weights.
- :mod:`miles.routing.record`: :class:`~miles.routing.record.RouteRecorder`, what the rollout engine records.
- :mod:`miles.routing.replay`: :class:`~miles.routing.replay.RouteReplay`, the trainer's forward on recorded
  routes (or compared with them).

Only the first is imported here (no torch): ``from miles.routing import Routes``.
"""

from miles.routing.routes import Routes, RoutesError, RouteShape, UnsupportedRouterError

__all__ = ["Routes", "RouteShape", "RoutesError", "UnsupportedRouterError"]
