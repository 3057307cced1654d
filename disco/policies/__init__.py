"""Stop policies: decide, after each draft token, whether to keep drafting."""

from disco.policies.auto import reads_costs, with_costs
from disco.policies.base import Decision, StopPolicy, block_budget
from disco.policies.spec import POLICY_INFOS, PolicyFactory, PolicySpec, parse_policy_spec

__all__ = ["Decision", "StopPolicy", "POLICY_INFOS", "PolicyFactory", "PolicySpec", "parse_policy_spec",
           "reads_costs", "with_costs", "block_budget"]
