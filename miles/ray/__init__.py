"""Ray orchestration: placement group, actor factory, train group, rollout manager.

Import-light on purpose: ``miles.ray.layout`` (pure helpers) is used inside train actors and unit
tests without Ray; the Ray-facing modules import Ray when they are imported themselves.
"""
