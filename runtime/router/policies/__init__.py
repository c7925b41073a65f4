"""Routing policies behind one contract, chosen by ``--policy`` from a registry."""

from kvflow.runtime.router.policies.base import Policy, Selection
from kvflow.runtime.router.policies.prefix_tree import PrefixMatch, PrefixTree
from kvflow.runtime.utils import Registry

__all__ = ["POLICIES", "Policy", "PrefixMatch", "PrefixTree", "Selection"]

# name -> factory(config: RouterConfig) -> Policy
POLICIES: Registry[Policy] = Registry("routing policy")
POLICIES.register("round_robin", "kvflow.runtime.router.policies.round_robin:RoundRobinPolicy")
POLICIES.register("power_of_two", "kvflow.runtime.router.policies.power_of_two:PowerOfTwoPolicy")
POLICIES.register("cache_aware", "kvflow.runtime.router.policies.cache_aware:CacheAwarePolicy")
